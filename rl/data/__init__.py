"""Trajectory data: tokenizers (HF + built-in bytes), ChatML rendering with append-only
updates, the trajectory schema and importers. The grain datasets live in `rl.data.datasets`,
imported on demand (grain imports JAX; this package must not)."""

from rl.data.chat import ChatRenderer, Message, generation_prompt, message_text, render_text
from rl.data.importers import (
    ImportConfig,
    ImportReport,
    TrajectoryImportError,
    import_file,
    import_files,
)
from rl.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerConfig,
    load_tokenizer,
)
from rl.data.trajectory import (
    Trajectory,
    Turn,
    load_trajectories,
    read_jsonl,
    render_token_view,
    validate,
    write_jsonl,
)

__all__ = [
    "ByteTokenizer",
    "ChatRenderer",
    "HFTokenizer",
    "ImportConfig",
    "ImportReport",
    "Message",
    "Tokenizer",
    "TokenizerConfig",
    "Trajectory",
    "TrajectoryImportError",
    "Turn",
    "generation_prompt",
    "import_file",
    "import_files",
    "load_tokenizer",
    "load_trajectories",
    "message_text",
    "read_jsonl",
    "render_text",
    "render_token_view",
    "validate",
    "write_jsonl",
]

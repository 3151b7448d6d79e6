"""The tiny model: a small random Qwen3 with a character-level tokenizer, saved in Hugging Face format."""

import dataclasses
import string
from pathlib import Path

from lib.config import UserError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
# Every character the synthetic tasks may produce: printable ASCII plus newline and tab.
CHARACTERS = sorted(set(string.printable) - {"\r", "\x0b", "\x0c"})

# Tool-call markers, single tokens as in Qwen (the train client's qwen3 tool parser finds them by id).
# Added after the characters, so every other token keeps its id.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

# Qwen-style turns. Each message renders on its own, so the first k turns are a token prefix of k + 1.
# Tools, when offered, are listed in the system turn (one JSON object per line inside <tools>); an
# assistant's tool calls follow its text as <tool_call>{"name": ..., "arguments": ...}</tool_call>, and
# a tool result is a user turn wrapped in <tool_response>, as in Qwen's template (shorter wording).
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "Tools:\n<tools>\n{% for tool in tools %}{{ (tool['function'] if 'function' in tool else tool) | tojson }}\n"
    '{% endfor %}</tools>\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set function = call['function'] if 'function' in call else call %}"
    '<tool_call>{"name": "{{ function[\'name\'] }}", "arguments": '
    "{{ function['arguments'] if function['arguments'] is string else function['arguments'] | tojson }}}"
    "</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass
class TinyConfig:
    hidden_size: int = 64
    """Width of the residual stream."""
    num_hidden_layers: int = 2
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Query heads."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """Width of each head: vLLM's CPU attention supports 32 and up, not 16. Four heads of 32 on a residual
    of 64 learn reverse_text better than two (reward after the demo's SFT 0.68 against 0.50 and 0.30 on
    two seeds), for ~1.5x the SFT step time."""
    intermediate_size: int = 256
    """Width of the MLP."""
    max_position_embeddings: int = 2048
    """Longest sequence, in characters."""
    seed: int = 0
    """Seed of the random initialisation: same seed, same weights."""

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError("num_attention_heads must be divisible by num_key_value_heads.")


def build_tokenizer():
    """A character-level fast tokenizer with the chat template above."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(TOOL_TOKENS)  # not special: decoding keeps them, as in Qwen's tokenizer
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(config: TinyConfig, vocab_size: int, eos_token_id: int, pad_token_id: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model_config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        # Untied, as Qwen3-8B and up; the tied output layer of Qwen3 up to 4B is tested on the Qwen-shaped
        # model (tests/test_qwen_vllm.py).
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(config.seed)
    return Qwen3ForCausalLM(model_config)


def write_tiny(out_dir: str | Path, config: TinyConfig | None = None) -> Path:
    """Writes tokenizer + model to `out_dir` (loadable by AutoModelForCausalLM / AutoTokenizer). Written
    beside and moved into place, so a write cut short leaves no model, or the previous one, never half of one."""
    import shutil

    config = config or TinyConfig()
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    model = build_model(config, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    partial = out_dir.absolute().with_name(f".{out_dir.absolute().name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a write that was killed
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    if not out_dir.exists():
        partial.rename(out_dir)
        return out_dir
    # The directory may hold files of the user's, so it is not replaced whole: file by file, config.json
    # last, which makes its presence the sign of a whole model (scripts/demo.py relies on it).
    for path in sorted(partial.iterdir(), key=lambda path: path.name == "config.json"):
        path.replace(out_dir / path.name)
    partial.rmdir()
    return out_dir

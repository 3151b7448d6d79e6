"""Other projects' config names (prime-rl, verifiers' RLTrainer, TRL's GRPOConfig) and plainrl's for each."""

import dataclasses
import difflib
import re
import types
import typing

GUIDE = "docs/coming-from.md"

# Their name -> the plainrl field it becomes, or (that field, or None; what to write instead). A name is a key, or the end
# of a dotted path (RLTrainer's trainer.args.learning_rate ends in learning_rate), or a table whose every key
# has one answer (inference.args). The field is checked against the script's config: sft.py has its own
# batch_size, eval.py no optimizer. What is not here but is one of plainrl's names under another table
# (prime-rl's trainer.optim.lr is optim.lr) is found by its end (plainrl_name).
FOREIGN: dict[str, str | tuple[str | None, str]] = {
    # verifiers' RLTrainer: vf-rl's one TOML (model, [env], [inference], [trainer.args])
    "model": ("model.name", "model.name, a table: [model] name = ..."),
    "inference.gpus": (
        "inference.urls",
        "inference.urls of servers you start with scripts/serve.py on other GPUs; else rl.py starts one beside "
        "the trainer",
    ),
    "inference.args": (
        None,
        "scripts/serve.py --vllm.extra-args, the server's own flags, then inference.urls",
    ),
    "trainer.gpus": (None, "torchrun --nproc-per-node N scripts/rl.py"),
    "run_name": ("output_dir", "output_dir, and wandb.name"),
    "use_lora": (
        "lora.rank",
        "lora.rank; 0, the default, trains every weight, where RLTrainer's LoRA is rank 8",
    ),
    "lora_rank": "lora.rank",
    "lora_r": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules",
    "learning_rate": "optim.lr",
    "lr_scheduler_type": ("optim.schedule", "optim.schedule: constant, linear or cosine"),
    "warmup_ratio": ("optim.warmup_steps", "optim.warmup_steps, in steps"),
    "max_norm": "optim.max_grad_norm",
    "micro_batch_size": (
        "micro_batch_size",
        "micro_batch_size; rl.py's counts packed rows of seq_len tokens, not rollouts",
    ),
    "batch_size": (
        "examples_per_step",
        "examples_per_step x rollouts_per_example; a batch_size counts rollouts: 128 = 8 x 16",
    ),
    "max_steps": "steps",
    "max_seq_len": "seq_len",
    "max_prompt_len": ("seq_len", "seq_len, prompt and completion together"),
    "gradient_checkpointing": "activation_checkpointing",
    "report_to": ("wandb.project", "wandb.project; tensorboard logs always"),
    "save_steps": "checkpoint_every",
    "num_batches_ahead": "max_async_level",
    "async_level": "max_async_level",
    "scale_rewards": ("advantage.normalize", "advantage.normalize: none, group or step"),
    "importance_sampling_level": "loss.ratio_level",
    "mask_truncated_completions": "loss.mask_truncated",
    "loss_type": ("loss.aggregation", "loss.aggregation, and the recipes in configs/recipes/"),
    "epsilon": ("loss.clip_low", "loss.clip_low, with loss.variant ppo"),
    "epsilon_high": "loss.clip_high",
    "bf16": "model.dtype",
    # prime-rl: rl's one TOML ([model], [orchestrator], [trainer], [inference]), sft, inference
    "interval": "checkpoint_every",
    "data.name": "data.id",
    "inference_gpu_ids": (None, "CUDA_VISIBLE_DEVICES of scripts/serve.py, then inference.urls"),
    "trainer_gpu_ids": (None, "CUDA_VISIBLE_DEVICES of rl.py"),
    "tp": "vllm.tensor_parallel_size",
    "dp": "vllm.data_parallel_size",
    "args": ("env.args", "env.args, a JSON string: args = '{\"min_turns\": 3}'"),
    # TRL's GRPOConfig
    "num_generations": "rollouts_per_example",
    "per_device_train_batch_size": (
        "micro_batch_size",
        "micro_batch_size; rl.py's counts packed rows of seq_len tokens, not rollouts",
    ),
    "gradient_accumulation_steps": (
        None,
        "none: a step trains on all of examples_per_step x rollouts_per_example, micro_batch_size rows at a time",
    ),
    "generation_batch_size": ("examples_per_step", "examples_per_step x rollouts_per_example"),
    "max_completion_length": "sampling.max_tokens",
    "max_prompt_length": ("seq_len", "seq_len, prompt and completion together"),
    "num_train_epochs": "steps",
    "beta": "loss.kl_coef",
    "model_name_or_path": "model.name",
    "use_vllm": "inference.engine",
    "vllm_server_base_url": "inference.urls",
    "vllm_gpu_memory_utilization": "inference.gpu_memory_utilization",
    # vf-eval
    "api_base_url": ("base_url", "base_url, -b"),
    "sampling_args": ("sampling.temperature", "sampling.temperature, sampling.top_p, ... one flag each"),
}


def dataclass_type(annotation) -> type | None:
    """The dataclass behind an annotation such as `ModelConfig` or `ModelConfig | None`, else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if dataclasses.is_dataclass(a)]
        return inner[0] if inner else None
    return None


def field_paths(config_class: type, prefix: str = "") -> list[str]:
    """Every field of a config as a dotted path (`optim.lr`), tables' fields included."""
    hints = typing.get_type_hints(config_class)
    paths = []
    for field in dataclasses.fields(config_class):
        if not field.init:
            continue
        nested = dataclass_type(hints[field.name])
        if nested is not None:
            paths += field_paths(nested, f"{prefix}{field.name}.")
        else:
            paths.append(prefix + field.name)
    return paths


def plainrl_name(config_class: type, path: str) -> tuple[str | None, str] | None:
    """plainrl's answer to another project's name `path` (dotted, underscores): (the field, what to write), or
    None when this config has nothing for it."""
    fields = field_paths(config_class)
    parts = path.split(".")
    ends = [".".join(parts[i:]) for i in range(len(parts))]  # longest first
    parents = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    for name in ends + parents:
        if name in FOREIGN:
            field, text = (FOREIGN[name],) * 2 if isinstance(FOREIGN[name], str) else FOREIGN[name]
            if field is None or field in fields or any(f.startswith(field + ".") for f in fields):
                return field, text
    for end in ends:  # the same name under another table: trainer.optim.lr is optim.lr
        if end in fields:
            return end, end
    same = [f for f in fields if f.rsplit(".", 1)[-1] == parts[-1]]
    return (same[0], " or ".join(same)) if same else None


def close_name(config_class: type, path: str) -> str | None:
    """The config's field closest in spelling to `path` (a typo), or None."""
    close = difflib.get_close_matches(path, field_paths(config_class), n=1, cutoff=0.75)
    return close[0] if close else None


def unknown_keys(config_class: type, paths: list[str], source: str) -> str:
    """One sentence naming every unknown key of a TOML file, each with plainrl's name for it where one is known."""
    named = []
    for path in paths:
        answer = plainrl_name(config_class, path)
        close = None if answer else close_name(config_class, path)
        named.append(
            f"{path} (plainrl: {answer[1]})"
            if answer
            else f"{path} (did you mean {close}?)"
            if close
            else path
        )
    keys = "key" if len(paths) == 1 else "keys"
    return (
        f"unknown config {keys} in {source}: {', '.join(named)}; {GUIDE} maps prime-rl's, verifiers' RLTrainer's "
        "and TRL's names to plainrl's."
    )


def flag_for(config_class: type, flag: str) -> str | None:
    """The flag plainrl has for an unknown `--flag` (another project's name, or a typo of a dotted one)."""
    path = flag.lstrip("-").replace("-", "_")
    answer = plainrl_name(config_class, path)
    field = answer[0] if answer else close_name(config_class, path)
    return "--" + field.replace("_", "-") if field else None


def plainrl_flag(config_class: type, message: str) -> str:
    """tyro's sentence for an unrecognized flag, with plainrl's flag for it where tyro offers none: another
    project's name (--learning-rate) or a typo in a dotted one."""
    found = re.match(r"Unrecognized options: (--[\w.-]+)", message)
    flag = flag_for(config_class, found.group(1)) if found and "(did you mean" not in message else None
    return f"{message.rstrip('.')} (did you mean {flag}?)." if flag else message


def leaves(value, path: str) -> list[str]:
    """The dotted paths of a TOML value's keys: its own for a value, its keys' for a table or an array of
    tables (prime-rl's [[orchestrator.env]])."""
    tables = (
        value if isinstance(value, list) and value and all(isinstance(v, dict) for v in value) else [value]
    )
    paths = []
    for table in tables:
        if isinstance(table, dict) and table:
            for key, inner in table.items():
                paths += [p for p in leaves(inner, f"{path}.{key.replace('-', '_')}") if p not in paths]
        elif path not in paths:
            paths.append(path)
    return paths

"""plainrl's vLLM worker extension, ServedWeights: loaded by vLLM's workers by dotted path (lib/inference/vllm.py)."""

import json
import sys


class ServedWeights:
    """vLLM worker extension: the `/collective_rpc` methods lib/inference/weights/reload.py calls after every reload, run in each
    engine's worker. `refresh_tied_output_layer` repacks a tied output layer (Qwen3 up to 4B) on the CPU
    build; `weight_fingerprint` shows what the engine computes with (lib/inference/weights/fingerprint.py).

    vLLM 0.32's CPU build computes the output layer from a packed copy of its weight, made once the weights
    are loaded; an in-place reload repacks the layers it loaded weights into, and the tied output layer gets
    none (its weight comes with the embedding), so it kept scoring with the first weights. On GPUs the
    output layer reads the embedding's tensor itself and there is nothing to refresh."""

    def refresh_tied_output_layer(self) -> bool:
        model = self.get_model()
        head, embedding = (
            getattr(model, "lm_head", None),
            getattr(getattr(model, "model", None), "embed_tokens", None),
        )
        if head is None or embedding is None or not hasattr(head, "cpu_linear"):
            return False
        head.weight = embedding.weight
        head.quant_method.process_weights_after_loading(head)
        return True

    def weight_fingerprint(self, written: str | None = None) -> dict:
        """{"dtype", "engine", "weights": {Hugging Face weight name: fingerprint}} of what this engine computes
        with. Given the `written` fingerprints (JSON), a ValueError names the first served weight that differs:
        with data parallel /collective_rpc answers with the first engine's result only, but any engine's
        error fails the call.

        A CPU build's linear layer (the output layer too) computes from a packed copy and keeps no weight:
        its kernel applied to one-hot inputs returns exact columns of what it computes with. Elsewhere (GPU
        kernels, embeddings, norms) the parameters are what the kernels read. A fused layer (qkv_proj,
        gate_up_proj) is split into the weights it was loaded from; a mixture of experts' weights are named
        as transformers fuses them (served_experts)."""
        import torch
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        from lib.inference.weights import fingerprint

        config = self.parallel_config
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            return {"unsupported": "tensor or pipeline parallel engines hold weights in shards"}
        model = self.get_model()
        packed = getattr(model, "packed_modules_mapping", {})
        served, dtype = {}, None
        for module_name, module in model.named_modules():
            name = module_name.replace(".base_layer", "")  # a LoRA-enabled layer wraps the base one
            if isinstance(module, LinearBase | ParallelLMHead):
                if isinstance(module, ParallelLMHead):
                    num_inputs, rows = module.embedding_dim, module.org_vocab_size
                else:  # a replicated layer (an MoE router) has no partitions
                    num_inputs = getattr(module, "input_size_per_partition", module.input_size)
                    rows = None
                dtype = dtype or (module.weight.dtype if module.weight.numel() else module.params_dtype)
                picked = fingerprint.columns(num_inputs)
                if hasattr(module, "cpu_linear"):
                    one_hot = torch.zeros(len(picked), num_inputs, dtype=module.params_dtype)
                    one_hot[torch.arange(len(picked)), picked] = 1
                    outputs = module.cpu_linear(one_hot, module.weight, None)  # (columns, outputs)
                else:
                    outputs = module.weight[:, picked.to(module.weight.device)].t()  # (columns, outputs)
                outputs = outputs[:, :rows]  # the output layer's padding rows are no weights
                parts = packed.get(name.rpartition(".")[2])
                if parts:
                    prefix = name.rpartition(".")[0]
                    sizes = module.output_partition_sizes
                    for part, values in zip(parts, outputs.split(sizes, dim=1), strict=True):
                        served[f"{prefix}.{part}.weight"] = fingerprint.of_values(values)
                else:
                    served[f"{name}.weight"] = fingerprint.of_values(outputs)
                if getattr(module, "bias", None) is not None:
                    served[f"{name}.bias"] = fingerprint.of_tensor(module.bias)
            elif isinstance(module, VocabParallelEmbedding):
                served[f"{name}.weight"] = fingerprint.of_tensor(module.weight[: module.org_vocab_size])
            elif isinstance(module, RoutedExperts):
                experts = served_experts(module)
                if isinstance(experts, str):
                    return {"unsupported": experts}
                served |= experts
            else:
                for param_name, param in module.named_parameters(recurse=False):
                    served[f"{name}.{param_name}"] = fingerprint.of_tensor(param)
        answer = {"dtype": str(dtype).removeprefix("torch."), "engine": config.data_parallel_index}
        answer["weights"] = served
        if written is not None:
            difference = fingerprint.first_difference(json.loads(written), served)
            if difference is not None:
                raise ValueError(
                    f"engine {config.data_parallel_index} computes with other weights: {difference}"
                )
        return answer


def served_experts(module) -> dict[str, list[float]] | str:
    """{"<layer>.gate_up_proj" and "<layer>.down_proj": fingerprint} of the expert weights (experts, outputs,
    inputs) a mixture-of-experts kernel reads, as transformers names and stacks them (what rl.py writes),
    or why they cannot be read here.

    vLLM's w13 is transformers' gate_up_proj (gate rows, then up rows). Triton's kernels read the weights
    as loaded; the CPU build's kernels read a copy packed once after loading (a permutation of the entries,
    the intermediate size zero-padded to its alignment), so the picked columns are found by packing a mask
    the same way. Other backends shuffle or quantize the weights, and expert parallel engines hold some
    experts only."""
    import torch
    from vllm import _custom_ops
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    from lib.inference.weights import fingerprint

    if module.local_num_experts != module.global_num_experts:
        return "expert parallel engines hold some of the experts each"
    backend = getattr(module.quant_method, "unquantized_backend", None)
    readable = (UnquantizedMoeBackend.TRITON, UnquantizedMoeBackend.BATCHED_TRITON, UnquantizedMoeBackend.CPU)
    if backend not in readable:
        return f"the experts' weights are in the {getattr(backend, 'value', 'quantized')} backend's layout"
    kernel = getattr(getattr(module.quant_method, "moe_kernel", None), "fused_experts", None)
    packed = isinstance(kernel, CPUUnquantizedExperts) and not kernel._use_zentorch
    intermediate = module.moe_config.intermediate_size_per_partition  # before the CPU build's padding
    served = {}
    for weight, part, num_inputs in (
        (module.w13_weight, "gate_up_proj", module.hidden_size),
        (module.w2_weight, "down_proj", intermediate),
    ):
        picked = fingerprint.columns(num_inputs).to(weight.device)  # padding columns come after these
        if packed:
            mask = torch.zeros_like(weight)
            mask[..., picked] = 1
            values = weight[_custom_ops.cpu_prepack_moe_weight(mask, kernel.isa) != 0]
        else:
            values = weight.index_select(-1, picked)
        served[f"{module.layer_name}.{part}"] = fingerprint.of_values(values)
    return served


# Inside vLLM's processes (it imports this module for the worker extension, after itself): plainrl's gloo
# weight-transfer engine, in case the vllm.general_plugins entry point is not installed (a plain checkout).
if "vllm.distributed" in sys.modules:
    from lib.inference.weights.vllm_transfer import register

    register()

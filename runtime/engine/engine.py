"""The engine: the data plane on every rank. ``forward_batch`` returns at once; only the consumer waits for the
tokens' device-to-host copy (ARCHITECTURE.md, "One step")."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import resource
from pathlib import Path

import numpy as np
import torch

from models import add_norm, fp8, gemv, invariant_linear
from models.config import ModelConfig
from models.context import ForwardContext
from models.ops import FLASHINFER_KERNELS, GPU_EXTRA, TORCH_KERNELS, flashinfer_installed
from models.weights.default_model import resolve_model_path
from models.weights.loader import KV_SCALE_ALIASES, KV_SCALES, load_model
from parallel.custom_all_reduce import make_custom_all_reduce
from parallel.distributed import agree_on_memory
from parallel.ordered_all_reduce import OrderedAllReduce
from parallel.state import assert_same_on_all_ranks, get_cpu_group, get_device_group, get_tp, set_custom_all_reduce
from runtime.batch import Batch
from runtime.config import RuntimeConfig
from runtime.engine.attention import make_attention_backend
from runtime.engine.decode_inputs import gather_torch
from runtime.engine.kv_cache import KVCache, compute_num_pages, page_bytes
from runtime.engine.logprobs import LogprobPlan, LogprobsOutput, compute_logprobs, plan_logprobs
from runtime.engine.sampler import Sampler
from runtime.utils import DUMMY_PAGE, concat_ranges, host_to_device

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ForwardOutput:
    next_tokens_gpu: torch.Tensor
    next_tokens_cpu: torch.Tensor
    copy_done_event: torch.cuda.Event | None  # None on CPU, where the copy is synchronous
    logprobs: LogprobsOutput | None = None


def wants_cuda(device: str) -> bool:
    """``engine.device``: ``auto`` means CUDA when this machine has it."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("engine.device=cuda but CUDA is not available on this machine")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _use_checkpoint_kv_scales(model: torch.nn.Module, kv_cache: KVCache, model_dir: Path) -> None:
    """An FP8 cache takes each layer's (k_scale, v_scale) from a checkpoint that has calibrated them."""
    if not model.config.kv_scales:
        return
    if not kv_cache.fp8:
        if get_tp().rank == 0:
            log.info("%s: the checkpoint's calibrated KV-cache scales are used only with cache.dtype=fp8_e4m3",
                     model_dir)
        return
    attns = [layer.self_attn for layer in model.model.layers]
    scales = torch.stack([torch.cat((attn.k_scale, attn.v_scale)) for attn in attns])
    older_names = {current: older for older, current in KV_SCALE_ALIASES.items()}
    for i, row in enumerate(scales.tolist()):
        for name, value in zip(KV_SCALES, row):
            if not 0 < value < float("inf"):  # zero, negative or NaN would wreck every cached value
                raise ValueError(f"{model_dir}: checkpoint tensor model.layers.{i}.{name} (or, under its older name, "
                                 f"model.layers.{i}.{older_names[name]}) is {value}; a KV-cache scale must be "
                                 "positive and finite")
    kv_cache.scales.copy_(scales)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


class Engine:
    def __init__(self, cfg: RuntimeConfig, model_dir: Path, model_config: ModelConfig) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        model_config = dataclasses.replace(model_config, quantization=cfg.model.quantization)
        self.model_config = model_config
        on_gpu = wants_cuda(cfg.engine.device)
        self.device = torch.device("cuda", get_tp().local_rank) if on_gpu else torch.device("cpu")
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        if on_gpu:
            torch.cuda.set_device(self.device)
        self.kv_dtype = fp8.FP8 if cfg.cache.dtype == "fp8_e4m3" else self.dtype
        if on_gpu and model_config.fp8:
            _check_fp8_gpu(self.device, self.dtype, "FP8 weights (model.quantization=fp8 or an FP8 checkpoint)")
        if on_gpu and self.kv_dtype == fp8.FP8:
            _check_fp8_gpu(self.device, self.dtype, "cache.dtype=fp8_e4m3")
        self.stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.max_seq_len = model_config.max_seq_len(cfg.model.max_seq_len)
        self.page_size = cfg.cache.page_size
        self.max_pages_per_req = -(-self.max_seq_len // self.page_size)
        self.max_running = cfg.scheduler.max_running_requests
        self.tp_size = get_tp().size
        self.dummy_row = self.max_running  # the extra last row: padding and discarded samples

        for key, value in (("engine.kernels", cfg.engine.kernels), ("engine.attention_backend", cfg.engine.attention_backend)):
            if value == "flashinfer" and not on_gpu:  # refused before the weights load, not minutes after
                raise ValueError(f"{key}=flashinfer needs a CUDA device")
        use_fi = on_gpu and flashinfer_installed() if cfg.engine.kernels == "auto" else cfg.engine.kernels == "flashinfer"
        if on_gpu and not use_fi and cfg.engine.kernels == "auto":
            log.warning("flashinfer is not installed: the GPU runs torch's kernels, without CUDA graphs (slow); "
                        "install the GPU extra: %s", GPU_EXTRA)
        kernels = FLASHINFER_KERNELS if use_fi else TORCH_KERNELS
        triton_gpu = use_fi and gemv.supported(self.device)
        if triton_gpu and add_norm.PREFERRED:
            kernels = dataclasses.replace(kernels, add_rms_norm=add_norm.add_rms_norm,
                                          add_rms_norm_quantize=add_norm.add_rms_norm_quantize)
        if triton_gpu:
            kernels = dataclasses.replace(kernels, silu_and_mul_quantize=fp8.silu_mul_quantize)
        # The fused single-token layers pay only inside CUDA graphs (Triton's eager launch overhead).
        fused = cfg.engine.fused_gemv != "never" and not cfg.engine.deterministic
        if fused and triton_gpu and self.tp_size == 1 and cfg.engine.cuda_graph_max_bs > 0:
            kernels = dataclasses.replace(kernels, fused_gemv=True)
        # The fused experts' tiles follow the batch's tokens per expert, so their bits may too: deterministic runs
        # take the experts one by one through the batch-invariant linear (eager: their sizes are on the host).
        if triton_gpu and model_config.is_moe and not cfg.engine.deterministic:
            kernels = dataclasses.replace(kernels, fused_moe=True)
        if cfg.engine.deterministic:
            kernels = dataclasses.replace(kernels, linear=self._invariant_linear(on_gpu))
        self.kernels = kernels
        free_before = self._free_memory()
        self.model = load_model(
            model_dir, model_config, self.device, self.dtype, self.max_seq_len + 1,
            random_seed=cfg.engine.seed if cfg.model.random_weights else None, kernels=kernels,
        )
        self.model_config = self.model.config  # as loaded: an LM head the checkpoint holds apart is untied
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        log.info(
            "rank %d: weights loaded (%.2f GiB on this rank), peak host memory so far %.2f GiB",
            get_tp().rank, self.weight_bytes / 2**30, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        )
        self.num_pages = self._determine_num_pages(free_before)
        heads = self.model.model.layers[0].self_attn
        self.kv_cache = KVCache(
            model_config.num_layers, self.num_pages, self.page_size, heads.num_kv_heads, model_config.head_dim,
            self.kv_dtype, self.device,
        )
        _use_checkpoint_kv_scales(self.model, self.kv_cache, model_dir)  # before the backend reads the scales
        rows = self.max_running + 1
        self.page_table = torch.full((rows, self.max_pages_per_req), DUMMY_PAGE, dtype=torch.int32, device=self.device)
        # Token ids live on the device so decode reads its input without waiting for the host.
        self.token_pool = torch.zeros(rows, self.max_seq_len + 1, dtype=torch.int32, device=self.device)
        self.attn_backend = make_attention_backend(
            cfg.engine.attention_backend, self.kv_cache, self.page_table, heads.num_heads, heads.num_kv_heads,
            model_config.head_dim, self.dtype, cfg.engine.deterministic,
        )
        self.ctx = ForwardContext(self.attn_backend)
        self.sampler = Sampler(model_config.vocab_size, self.device, use_kernels=on_gpu, token_pool=self.token_pool)
        self._setup_collectives_and_graphs()

    def _invariant_linear(self, on_gpu: bool):  # noqa: ANN202 - a linear function
        if not on_gpu:
            return invariant_linear.cpu_linear
        if invariant_linear.triton is None:
            raise RuntimeError("engine.deterministic=true on a GPU needs Triton (pip install triton)")
        return invariant_linear.BatchInvariantLinear()

    def _setup_collectives_and_graphs(self) -> None:
        """The custom all-reduce first (the graphs capture it), then the decode CUDA graphs."""
        cfg = self.cfg
        decode_tokens = max(min(cfg.engine.cuda_graph_max_bs or self.max_running, self.max_running), 1)
        self.custom_all_reduce = make_custom_all_reduce(
            cfg.parallel.all_reduce, get_device_group(), get_cpu_group(), self.tp_size, self.device, self.dtype,
            decode_tokens * self.model_config.hidden_size * self.dtype.itemsize,
        )
        if cfg.engine.deterministic and self.tp_size > 1:
            self.custom_all_reduce = OrderedAllReduce(get_device_group(), self.tp_size)
        set_custom_all_reduce(self.custom_all_reduce)
        if self.stream is not None:
            # The pools were filled on the default stream; without this wait the engine stream's first gather
            # could read a reused block's stale contents as page ids (an illegal memory access).
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.check_tokens = cfg.parallel.check_tokens and self.tp_size > 1
        self.graph_runner = None
        # The unfused experts size their work on the host (tokens per expert), which a graph cannot capture.
        graphs = cfg.engine.cuda_graph_max_bs > 0 and (self.kernels.fused_moe or not self.model_config.is_moe)
        if self.stream is not None and cfg.engine.cuda_graph_max_bs > 0 and not graphs:
            log.warning("%s without Triton: the experts run unfused and without CUDA graphs",
                        self.model_config.architecture)
        if self.stream is not None and self.attn_backend.supports_graphs and graphs:
            from runtime.engine.graph import GraphRunner

            prefill_tokens = min(cfg.engine.cuda_graph_prefill_tokens, cfg.scheduler.max_prefill_tokens,
                                 self.max_running * self.max_seq_len)
            if self.kv_cache.fp8:  # its prefill copies a batch-sized set of pages: eager (see flashinfer_backend.py)
                prefill_tokens = 0
            with torch.cuda.stream(self.stream):
                self.graph_runner = GraphRunner(self, min(cfg.engine.cuda_graph_max_bs, self.max_running), prefill_tokens)
        if self.stream is not None:
            torch.cuda.synchronize(self.device)

    @classmethod
    def from_config(cls, cfg: RuntimeConfig) -> Engine:
        model_dir = resolve_model_path(cfg.model.path)
        return cls(cfg, model_dir, ModelConfig.from_dir(model_dir))

    def _free_memory(self, placed_bytes: int = 0) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.mem_get_info(self.device)[0]
        # On CPU a configured budget stands in for free device memory, less what this engine has placed.
        return self.cfg.cache.cpu_memory_bytes - placed_bytes

    def _determine_num_pages(self, free_before_local: int) -> int:
        min_before, max_before, min_after = agree_on_memory(free_before_local, self._free_memory(self.weight_bytes))
        margin = self.cfg.parallel.memory_imbalance_bytes
        if max_before - min_before > margin:
            raise RuntimeError(
                f"free device memory differs across ranks by {(max_before - min_before) / 2**30:.2f} GiB "
                f"(min {min_before / 2**30:.2f}, max {max_before / 2**30:.2f}), more than "
                f"parallel.memory_imbalance_bytes={margin}; is another job using some of the GPUs?"
            )
        model_bytes = min_before - min_after
        local_heads = self.model.model.layers[0].self_attn.num_kv_heads
        per_page = page_bytes(self.model_config.num_layers, local_heads, self.model_config.head_dim, self.page_size,
                              self.kv_dtype)
        if self.cfg.cache.num_pages > 0:
            num_pages = self.cfg.cache.num_pages
        else:
            num_pages = compute_num_pages(min_before, model_bytes, self.cfg.cache.memory_ratio, per_page)
            # More pages than every running request at full length could use would sit idle.
            num_pages = min(num_pages, self.max_running * self.max_pages_per_req + 1)
        if num_pages < 2:
            raise RuntimeError(
                f"no room for the KV cache: {num_pages} pages of {per_page} bytes after the model ({model_bytes} bytes);"
                " raise cache.memory_ratio (GPU) or cache.cpu_memory_bytes (CPU), or use more GPUs"
            )
        log.info("KV cache: %d pages of %d tokens (%.2f GiB)", num_pages, self.page_size, num_pages * per_page / 2**30)
        return num_pages

    def _stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _prepare_inputs(
        self, batch: Batch, plan: LogprobPlan | None = None, graph: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write admissions into the device pools, then gather this step's inputs; the host's part is one copy."""
        ext = batch.ext_lens
        if batch.is_decode:
            tok_rows, tok_pos = batch.rows, batch.starts
        else:
            tok_rows, tok_pos = np.repeat(batch.rows, ext), concat_ranges(ext, batch.starts)
            if graph:
                pad = batch.padded_size - len(tok_rows)
                tok_rows = np.concatenate((tok_rows, np.full(pad, self.dummy_row, np.int32)))
                tok_pos = np.concatenate((tok_pos, np.zeros(pad, np.int64)))
        adm_tok_rows = np.repeat(batch.admit_rows, batch.admit_token_lens)
        adm_tok_cols = concat_ranges(batch.admit_token_lens)
        adm_page_rows = np.repeat(batch.admit_rows, batch.admit_page_lens)
        adm_page_cols = concat_ranges(batch.admit_page_lens)
        logits_idx = np.cumsum(ext) - 1
        if plan is not None:
            logits_idx = np.concatenate((logits_idx, plan.extra_index))
        parts = [
            tok_rows, tok_pos, batch.sample_rows, batch.kv_lens, logits_idx,
            adm_tok_rows, adm_tok_cols, batch.admit_tokens, adm_page_rows, adm_page_cols, batch.admit_pages,
            *(plan.upload_parts() if plan is not None else ()),
        ]
        sizes = [len(p) for p in parts]
        upload = host_to_device(np.concatenate(parts).astype(np.int64), self.device)
        dev = upload.split(sizes)
        rows, pos, sample_rows, kv_lens, last_idx, a_rows, a_cols, a_tok, p_rows, p_cols, p_ids = dev[:11]
        if len(a_rows):
            self.token_pool[a_rows, a_cols] = a_tok.int()
        if len(p_rows):
            self.page_table[p_rows, p_cols] = p_ids.int()
        if plan is not None:
            plan.bind(list(dev[11:]), self.token_pool)  # prompt targets: read after admissions are written
        batch.logits_indices = None if batch.is_decode else last_idx
        if not graph:
            batch.input_ids, batch.out_loc = gather_torch(self.token_pool, self.page_table, rows, pos, self.page_size)
            batch.positions = pos
            batch.req_rows = rows if batch.is_decode else None
        return sample_rows, kv_lens, upload[: len(rows) + len(pos)]

    def forward_batch(self, batch: Batch) -> ForwardOutput:
        n = batch.size
        with self._stream():
            plan = plan_logprobs(batch, self.dummy_row)
            size = None
            if self.graph_runner is not None:
                size = self.graph_runner.graph_size(batch, len(plan.extra_index) if plan is not None else 0)
            use_graph = size is not None
            run = self.graph_runner.pad(batch, size) if use_graph else batch
            sample_rows, kv_lens, rows_pos = self._prepare_inputs(run, plan, graph=use_graph)
            args = self.sampler.prepare(batch)
            with self.ctx.forward_batch(run):
                if use_graph:
                    logits = self.graph_runner.replay(run, rows_pos)
                else:
                    self.attn_backend.prepare(run)
                    logits = self.model.forward()
            # Bookkeeping before the step returns, so the scheduler's next decision sees it.
            for req, ext_len in zip(batch.reqs, batch.ext_lens.tolist()):
                req.complete_one(ext_len)
            next_tokens = self.sampler.sample(logits[:n], args).to(torch.int32)
            if self.check_tokens:
                assert_same_on_all_ranks(next_tokens, "sampled tokens")
            self.token_pool[sample_rows[:n], kv_lens[:n]] = next_tokens
            # Every rank computes them (the logits are all-gathered), so every rank runs the same kernels.
            logprobs = compute_logprobs(plan, logits, next_tokens, n) if plan is not None else None
            if self.stream is None:
                return ForwardOutput(next_tokens, next_tokens, None, logprobs)
            next_cpu = torch.empty(n, dtype=torch.int32, pin_memory=True)
            next_cpu.copy_(next_tokens, non_blocking=True)
            host_logprobs = logprobs.to_host() if logprobs is not None else None
            event = torch.cuda.Event()
            event.record(self.stream)
        return ForwardOutput(next_tokens, next_cpu, event, host_logprobs)

    def close(self) -> None:
        """Release the CUDA graphs and the custom all-reduce; call before destroying the process groups, since
        ``ncclCommDestroy`` waits until every graph that captured an NCCL collective is gone."""
        if self.graph_runner is not None:
            self.graph_runner.close()
            self.graph_runner = None
        if self.custom_all_reduce is not None:
            set_custom_all_reduce(None)
            self.custom_all_reduce = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _check_fp8_gpu(device: torch.device, dtype: torch.dtype, setting: str) -> None:
    """FP8 GEMMs with row-wise scales and the e4m3 conversions need Ada or Hopper; FP8 runs beside bfloat16."""
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{setting} needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                         f"{torch.cuda.get_device_name(device)} is {torch.cuda.get_device_capability(device)}")
    if dtype != torch.bfloat16:
        raise ValueError(f"{setting} on the GPU runs in bfloat16; model.dtype resolved to {dtype}")

"""Tiny random HF models written to safetensors, for tests of the loader, models and engine.

Each writer saves a transformers model (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 260) with
`save_pretrained(safe_serialization=True)` plus a byte-level tokenizer with a chat template, and
returns the directory. Use `write_tiny_model(arch, path)` or the per-architecture helpers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt_oss")
VOCAB = 260  # 256 bytes + 4 specials
SLIDING_WINDOW = 8  # Mistral's window in the fixtures: short, so that tests cross it
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")


def tiny_config(arch: str, **overrides):
    """The transformers config of a tiny model of `arch`."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=256,
                  eos_token_id=258, pad_token_id=259)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 10000.0})
    elif arch == "llama3":  # llama3 rope scaling, tied embeddings (SmolLM2 / Llama 3.2 style)
        common.update(tie_word_embeddings=True)
        cfg = transformers.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=SLIDING_WINDOW, head_dim=16)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**{**common, "head_dim": 32})
    elif arch == "gemma2":  # windows on alternate layers, both soft-caps, its own softmax scale
        cfg = transformers.Gemma2Config(
            **{**common, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=SLIDING_WINDOW, attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_implementation="eager")  # (HF's sdpa path has no soft-cap)
    elif arch == "gemma3":  # q/k norms, a rope per layer type (local and global)
        cfg = transformers.Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=24,
            sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                "rope_theta": 10000.0}},
            attn_implementation="eager")
    elif arch == "gpt_oss":  # sinks, alternating windows, YaRN, biased router and experts
        cfg = transformers.GptOssConfig(
            **{**common, "num_hidden_layers": 3, "intermediate_size": 48}, head_dim=16,
            sliding_window=SLIDING_WINDOW, num_local_experts=4, num_experts_per_tok=2,
            # YaRN with a short original context, so that its ramp falls inside the 8 frequencies
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64},
            attn_implementation="eager")  # (HF has no sdpa path for sinks)
    else:
        raise ValueError(f"no tiny fixture for {arch!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    """A random transformers model (fp32, eval mode) with weights large enough to matter."""
    import transformers

    cfg = tiny_config(arch, **overrides)
    cls = {"llama": transformers.LlamaForCausalLM, "llama3": transformers.LlamaForCausalLM,
           "mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "gemma2": transformers.Gemma2ForCausalLM,
           "gemma3": transformers.Gemma3ForCausalLM,
           "gpt_oss": transformers.GptOssForCausalLM}[arch]
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        # HF's init (std 0.02) makes near-uniform logits; larger weights make the test sharper.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):  # GPT-OSS: logits on the scale of the scores
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1))
            # GPT-OSS: gate / up values of about 5, so that its SwiGLU's clamps at 7 bite (a
            # smaller swiglu_limit would do, but transformers before 5.2x ignores the config's
            # and clamps at 7); down scaled back so the experts' outputs stay O(1)
            if name.endswith("experts.gate_up_proj"):
                p.mul_(12.0)
            elif name.endswith("experts.down_proj"):
                p.mul_(1 / 12.0)
    return model


def write_tokenizer(path: str | os.PathLike) -> None:
    """A byte-level BPE tokenizer without merges (ids 0..255 are bytes) and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # order the byte symbols by their byte value so that id == byte
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    for i, s in enumerate(SPECIALS):
        vocab[s] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0],
                                   eos_token=SPECIALS[2], pad_token=SPECIALS[3],
                                   additional_special_tokens=list(SPECIALS[1:3]))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def write_config_model(path: str | os.PathLike, config: dict) -> str:
    """A dummy-weight model directory: `config` as config.json plus the byte-level tokenizer
    (outputs are compared as token ids)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    write_tokenizer(path)
    return str(path)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable mapping of bytes, the one ByteLevel uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def write_tiny_model(arch: str, path: str | os.PathLike, seed: int = 0, tokenizer: bool = True,
                     max_shard_size: str | None = None, **overrides) -> Path:
    """Save a tiny random `arch` model (safetensors) and tokenizer into `path`; returns it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_hf_model(arch, seed, **overrides)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    if tokenizer:
        write_tokenizer(path)
    return path


def write_tiny_llama(path, **kw) -> Path:
    return write_tiny_model("llama", path, **kw)


def write_tiny_mistral(path, **kw) -> Path:
    return write_tiny_model("mistral", path, **kw)


def write_tiny_qwen2(path, **kw) -> Path:
    return write_tiny_model("qwen2", path, **kw)


def write_tiny_qwen3(path, **kw) -> Path:
    return write_tiny_model("qwen3", path, **kw)


def write_tiny_gpt_oss(path, **kw) -> Path:
    return write_tiny_model("gpt_oss", path, **kw)


class PagedHarness:
    """A minimal stand-in for the engine's memory pool, for driving a model or backend in tests.

    Hands out pages in a shuffled order (so a request's slots are scattered, never contiguous),
    keeps a req_to_token table, and builds ForwardBatch objects for extend and decode steps.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int = 4,
                 num_pages: int = 64, max_reqs: int = 8, max_context: int = 256,
                 dtype: torch.dtype = torch.float32, backend=None, seed: int = 0,
                 v_head_dim: int | None = None):
        from core.engine.memory.kv_cache import KVPool

        self.page_size = page_size
        self.pool = KVPool(num_pages * page_size, num_layers, num_kv_heads, head_dim, dtype,
                           "cpu", page_size, v_head_dim=v_head_dim)
        g = torch.Generator().manual_seed(seed)
        # page 0 holds the reserved padding slot 0: never handed out
        self.free_pages = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32)
        self.lens: dict[int, int] = {}  # row -> tokens stored
        self.pages: dict[int, list[int]] = {}
        self.backend = backend

    def _slots(self, row: int, n: int) -> list[int]:
        start = self.lens.get(row, 0)
        pages = self.pages.setdefault(row, [])
        out = []
        for pos in range(start, start + n):
            if pos // self.page_size >= len(pages):
                pages.append(self.free_pages.pop())
            out.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        self.req_to_token[row, start:start + n] = torch.tensor(out, dtype=torch.int32)
        self.lens[row] = start + n
        return out

    def batch(self, rows: list[int], new_tokens: list[list[int]], decode: bool = False):
        """ForwardBatch appending new_tokens[i] to request row rows[i] (positions continue)."""
        from core.contract.forward_batch import ForwardBatch, ForwardMode

        prefix = [self.lens.get(r, 0) for r in rows]
        locs = [s for r, toks in zip(rows, new_tokens, strict=True) for s in self._slots(r, len(toks))]
        seq = [self.lens[r] for r in rows]
        ext = [len(t) for t in new_tokens]
        positions = [p for pre, n in zip(prefix, ext, strict=True) for p in range(pre, pre + n)]
        fb = ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            seq_lens=torch.tensor(seq, dtype=torch.int32),
            prefix_lens=torch.tensor(prefix, dtype=torch.int32),
            extend_lens=torch.tensor(ext, dtype=torch.int32),
            out_cache_loc=torch.tensor(locs, dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            req_to_token=self.req_to_token, kv_pool=self.pool,
            seq_lens_cpu=seq, prefix_lens_cpu=prefix, extend_lens_cpu=ext,
            attn_backend=self.backend)
        self.pool.begin_step()  # as the model runner does before every forward
        if self.backend is not None:
            fb.attn_meta = self.backend.prepare(fb)
        return fb

    def share_prefix(self, src_row: int, dst_row: int, n: int) -> None:
        """Make request dst_row start with src_row's first n tokens (their pages shared, as the
        radix cache does); n must be a whole number of pages."""
        if n % self.page_size:
            raise ValueError("shared prefixes must be page aligned")
        self.req_to_token[dst_row, :n] = self.req_to_token[src_row, :n]
        self.pages[dst_row] = list(self.pages[src_row][:n // self.page_size])
        self.lens[dst_row] = n


def cpu_plan(model_impl: str = "llama", dtype: str = "float32", page_size: int = 4):
    """A resolver-free Plan for tests: torch_native everywhere on the CPU."""
    from core.contract.capabilities import DeviceInfo
    from core.plan.plan import Plan

    return Plan(device=DeviceInfo(target="cpu", device_type="cpu"), dtype=dtype,
                prefill_attention="torch_native", decode_attention="torch_native",
                moe_runner=None, quant_method="unquantized", kv_cache_dtype=dtype,
                page_size=page_size, cuda_graph=False, model_impl=model_impl)


def torch_native_backend(config, dtype: torch.dtype = torch.float32, page_size: int = 4):
    """The torch_native backend for a model config (as the engine would build it)."""
    from core.contract.attention import BackendContext
    from plugins.attention.torch_native.backend import TorchNativeAttention

    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    return TorchNativeAttention(BackendContext(
        num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim, num_layers=config.num_hidden_layers, dtype=dtype, kv_dtype=dtype,
        device=torch.device("cpu"), page_size=page_size,
        max_context_len=config.max_position_embeddings))


def prefill_logits(model, config, ids):
    """Logits [len(ids), vocab] of one request prefilled through the paged harness."""
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    h = PagedHarness(config.num_hidden_layers, config.num_key_value_heads, head_dim, 4,
                     num_pages=256, max_context=512, backend=torch_native_backend(config),
                     dtype=next(model.parameters()).dtype)
    batch = h.batch([0], [ids])
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch))


LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(arch: str, path: str | os.PathLike, r: int, alpha: float,
                       target_modules=LORA_ALL, seed: int = 1, use_rslora: bool = False,
                       base_seed: int = 0) -> Path:
    """A random PEFT LoRA adapter of the tiny `arch` model (written with base_seed), saved as
    PEFT saves one (adapter_config.json + adapter_model.safetensors). A and B are both random
    (init_lora_weights=False: PEFT's own B starts at zero, which would test nothing)."""
    from peft import LoraConfig, get_peft_model

    path = Path(path)
    base = tiny_hf_model(arch, base_seed)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha,
                                            target_modules=list(target_modules),
                                            init_lora_weights=False, use_rslora=use_rslora))
    model.save_pretrained(str(path))
    return path


def write_config_adapter(path, cfg, r: int, alpha: float, seed: int, dtype: torch.dtype):
    """A random PEFT adapter (PEFT's file names and keys) on every projection of `cfg`'s
    Llama, its shapes read from the config (no base model needed to write it): A ~ N(0, 1/in),
    B ~ N(0, 0.02^2), in `dtype`."""
    from safetensors.torch import save_file

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for module, (n_in, n_out) in shapes.items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, n_in, generator=g)
                                               / n_in ** 0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, r, generator=g)
                                               * 0.02).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as fh:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
                   "target_modules": list(shapes), "bias": "none", "lora_dropout": 0.0,
                   "base_model_name_or_path": None}, fh)
    return path


def peft_reference(arch: str, adapter: str | os.PathLike | None, base_seed: int = 0):
    """HF transformers (+ PEFT's adapter when given), fp32, eval mode: the reference."""
    model = tiny_hf_model(arch, base_seed)
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter)).eval()


def greedy_reference(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens after `ids` and each one's logprob, recomputing the whole sequence each
    step (no cache: the plainest reference)."""
    seq, toks, lps = list(ids), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(torch.argmax(lp))
            toks.append(tok)
            lps.append(float(lp[tok]))
            seq.append(tok)
    return toks, lps

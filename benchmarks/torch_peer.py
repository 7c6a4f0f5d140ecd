"""The torch side of benchmarks/gpu_peer.py: one torch training run of the peer model, at its
best settings, in a process of its own. Imports neither jax nor jaxtrain (it may run under
another Python, `gpu_peer.py --torch-python`); torch is imported only inside `worker`, so the
choices below parse and validate without it.

A run (`TorchRun`) is one point of:

- `model`: `transformers` (`LlamaForCausalLM`, SDPA attention) or `torchtitan` (torchtitan
  0.3.0's Llama 3 model, `torchtitan.models.llama3`, with its own language-model attention,
  FlexAttention with a causal document mask: each row is one document);
- `compile`: eager, or `torch.compile` of the whole step (forward, loss, backward, gradient
  clipping, AdamW) in `mode` `default` or `max-autotune`; what does not compile runs eager
  between graphs, and Dynamo's counters say how many graph breaks and graphs there were and
  why it broke;
- `attention` (transformers only): SDPA's backends as torch picks them (`auto`), or one pinned
  with `torch.nn.attention.sdpa_kernel` (`cudnn`, `flash`: FlashAttention-2, `efficient`:
  memory-efficient); the SDPA operators that actually ran are read from a profile of one
  untimed step (`aten::_scaled_dot_product_<backend>_attention`);
- `loss`: transformers' (`hf`: the full [batch, seq, vocab] logits, then cross-entropy) or
  Liger's fused linear cross-entropy (`liger`: `LigerFusedLinearCrossEntropyLoss`, the head's
  matmul and the loss in chunks, never the whole logits; Triton, so CUDA only);
- `remat`: `none` (torch's default: every activation kept) or `full` (each layer recomputed
  in the backward: transformers' gradient checkpointing, or torchtitan's per-block wrapper).

Weights in float32 with bf16 autocast, fused AdamW (lr 3e-4), clip 1.0, random tokens with
labels = inputs, as jaxtrain's side. Every step is timed to torch.cuda.synchronize.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

MODELS = ("transformers", "torchtitan")
ATTENTION = ("auto", "cudnn", "flash", "efficient")
LOSSES = ("hf", "liger")
COMPILE_MODES = ("default", "max-autotune")
REMAT = ("none", "full")
CUDA_ONLY_ATTENTION = ("cudnn", "efficient")


@dataclasses.dataclass(frozen=True)
class TorchRun:
    label: str
    model: str = "transformers"
    compile: bool = False
    mode: str = "default"
    attention: str = "auto"
    loss: str = "hf"
    remat: str = "none"

    def __post_init__(self):
        for key, value, allowed in (
            ("model", self.model, MODELS),
            ("mode", self.mode, COMPILE_MODES),
            ("attention", self.attention, ATTENTION),
            ("loss", self.loss, LOSSES),
            ("remat", self.remat, REMAT),
        ):
            if value not in allowed:
                raise ValueError(
                    f"torch run {self.label!r}: {key}={value!r}: expected one of {', '.join(allowed)}"
                )
        if self.model == "torchtitan" and self.attention != "auto":
            raise ValueError(
                f"torch run {self.label!r}: attention={self.attention!r}: torchtitan runs its own "
                "language-model attention (FlexAttention); expected auto"
            )

    def describe(self) -> str:
        parts = [self.model, f"compile {self.mode}" if self.compile else "eager"]
        parts.append(f"sdpa {self.attention}" if self.model == "transformers" else "flex attention")
        parts += [f"loss {self.loss}", f"remat {self.remat}"]
        return ", ".join(parts)


def parse_runs(text: str, defaults: TorchRun) -> list[TorchRun]:
    """`label:key=value ...;label:...` -> runs, each starting from `defaults` (keys: model,
    compile (0/1), mode, attention, loss, remat)."""
    runs = []
    fields = {f.name for f in dataclasses.fields(TorchRun)} - {"label"}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        label, _, tokens = entry.partition(":")
        changes: dict = {}
        for token in tokens.split():
            key, sep, value = token.partition("=")
            if not sep or key not in fields:
                raise ValueError(
                    f"torch run {label.strip()!r}: {token!r}: expected KEY=VALUE, KEY one of {sorted(fields)}"
                )
            if key == "compile":
                if value not in ("0", "1"):
                    raise ValueError(f"torch run {label.strip()!r}: compile={value!r}: expected 0 or 1")
                changes[key] = value == "1"
            else:
                changes[key] = value
        runs.append(dataclasses.replace(defaults, label=label.strip(), **changes))
    labels = [r.label for r in runs]
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        raise ValueError(f"torch runs: labels {dupes} given twice")
    return runs


def refusal(run: TorchRun, cuda: bool) -> str | None:
    """Why `run` cannot run on this device, in one line, or None."""
    if cuda:
        return None
    if run.attention in CUDA_ONLY_ATTENTION:
        return f"attention={run.attention}: torch's {run.attention} SDPA backend needs a CUDA device"
    if run.loss == "liger":
        return "loss=liger: Liger's kernels are Triton, CUDA only"
    if run.model == "torchtitan":
        return "model=torchtitan: its FlexAttention has no backward on CPU (torch raises), CUDA only"
    return None


def tinfo_versions() -> dict:
    from importlib import metadata

    found = {}
    for name in ("torch", "transformers", "liger-kernel", "torchtitan", "triton"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


# ---------------------------------------------------------------- models


def transformers_model(shape: dict, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["d_model"],
        intermediate_size=shape["mlp_dim"],
        num_hidden_layers=shape["n_layers"],
        num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["seq"],
        rope_theta=shape["rope_theta"],
        tie_word_embeddings=shape["tie_embeddings"],
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def torchtitan_model(shape: dict, torch):
    """torchtitan 0.3.0's Llama 3 of the shape, its layers as its own presets build them
    (`torchtitan.models.llama3._build_llama3_layers`, FlexAttention), weights initialised by
    its `init_states`."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    if shape["tie_embeddings"]:
        raise ValueError("torchtitan peer: tie_embeddings=true is not wired; the peer model is untied")
    if shape["d_model"] != shape["n_heads"] * shape["head_dim"]:
        raise ValueError(
            f"torchtitan peer: head_dim={shape['head_dim']}: torchtitan's Llama 3 takes "
            f"d_model / n_heads = {shape['d_model'] // shape['n_heads']}"
        )
    dim, vocab = shape["d_model"], shape["vocab_size"]
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=_build_llama3_layers(
            n_layers=shape["n_layers"],
            dim=dim,
            n_heads=shape["n_heads"],
            n_kv_heads=shape["n_kv_heads"],
            hidden_dim=shape["mlp_dim"],
            rope=ComplexRoPE.Config(
                dim=shape["head_dim"], max_seq_len=shape["seq"], theta=shape["rope_theta"]
            ),
            attn_backend="flex",
        ),
    )
    model = config.build()
    model.init_states()
    return model


# ---------------------------------------------------------------- the run


def worker(shape: dict, run: TorchRun, total_steps: int) -> dict:
    """Train `total_steps` steps of `run`; every step's seconds and what ran."""
    import torch
    import torch.nn.functional as F

    cuda = torch.cuda.is_available()
    if why := refusal(run, cuda):
        raise SystemExit(f"torch run {run.label!r}: {why}")
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    with device:
        model = (transformers_model if run.model == "transformers" else torchtitan_model)(shape, torch)
    model = model.to(device)  # float32 weights already; a dtype here would cast RoPE's complex buffer
    model.train()
    params = sum(p.numel() for p in model.parameters())
    if run.remat == "full":
        if run.model == "transformers":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for key, block in list(model.layers.items()):
                model.layers[key] = checkpoint_wrapper(block, preserve_rng_state=False)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        fused = True
    except (RuntimeError, TypeError, ValueError):  # fused AdamW unsupported on this device
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        fused = False

    b, s = shape["batch"], shape["seq"]
    positions = torch.arange(s, device=device).expand(b, s)
    liger = None
    if run.loss == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()

    def hidden_and_head(x):
        """(final hidden states, the head's weight) or (logits, None)."""
        if run.model == "transformers":
            if liger is not None:
                return model.model(input_ids=x).last_hidden_state, model.lm_head.weight
            return None, None
        masks = model.get_attention_masks(positions)
        model._skip_lm_head = liger is not None
        out = model(x, positions, masks)
        return (out, model.lm_head.weight) if liger is not None else (out, None)

    def loss_of(x):
        h, weight = hidden_and_head(x)
        if run.model == "transformers" and liger is None:
            return model(input_ids=x, labels=x).loss
        targets = x[:, 1:].reshape(-1)
        if liger is not None:
            return liger(weight, h[:, :-1].reshape(-1, h.shape[-1]), targets)
        return F.cross_entropy(h[:, :-1].reshape(-1, h.shape[-1]).float(), targets)

    def step(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_of(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if run.compile:
        import torch._dynamo

        torch._dynamo.utils.counters.clear()
        step = torch.compile(step, mode=run.mode)
    gen = torch.Generator(device=device).manual_seed(0)
    batches = torch.randint(0, shape["vocab_size"], (total_steps + 1, b, s), device=device, generator=gen)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend = sdpa_backend(run.attention, torch)
    times, losses = [], []
    with backend:
        for i in range(total_steps):
            sync()
            t0 = time.perf_counter()
            loss = step(batches[i])
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
        sdpa_ops = sdpa_ops_of(lambda: step(batches[total_steps]), torch, cuda)
    result = {
        "run": dataclasses.asdict(run),
        "step_times_s": times,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "reserved_memory_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "final_loss": losses[-1],
        "params": params,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "fused_adamw": fused,
        "sdpa_ops": sdpa_ops,
        "versions": tinfo_versions(),
    }
    if run.compile:
        counters = torch._dynamo.utils.counters
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["graph_break_reasons"] = [str(k)[:200] for k in list(counters["graph_break"])[:5]]
        result["graphs"] = counters["stats"].get("unique_graphs", 0)
    return result


def sdpa_backend(name: str, torch):
    """The context that pins SDPA to `name` (nothing for `auto`)."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pinned = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    return sdpa_kernel([pinned[name]])


def sdpa_ops_of(one_step, torch, cuda: bool) -> list[str]:
    """The attention operators one (untimed) step runs, from a profile of it: which SDPA
    backend torch took, or FlexAttention's."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one_step()
        if cuda:
            torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    return sorted(n for n in names if "scaled_dot_product" in n or "flex_attention" in n)

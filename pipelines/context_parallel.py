"""Context parallelism for the apps: ``--cp ulysses=N,ring=M``, the process group that torchrun describes,
diffusers' ``enable_parallelism`` on a transformer (Wan's, or any other that diffusers has a context-parallel
plan for: FLUX, Qwen-Image, LTX-Video, ...), and which rank writes.

    torchrun --nproc-per-node 2 -m fp4vis.cli generate --model ... --prompt ... --cp ulysses=2

Every rank runs the same pipeline on its own device (``cuda:LOCAL_RANK``; NCCL on GPUs, gloo on the
CPU); diffusers splits each transformer pass over the ranks and gathers its output, so every rank
ends with the same latents, and rank 0 alone decodes and writes. The FP4 attention under diffusers'
split is ``fp4vis.patching.context_parallel``.

From Python, on a launch of one's own, none of this is needed: initialise the process group, call
``pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=N))`` and patch the
pipeline as usual. ``enable_context_parallel`` does the same, plus the checks below and two things
diffusers 0.42 does not do by itself: on a machine without an accelerator its ``enable_parallelism``
divides by the accelerator count (zero), so the same steps run through its hook API
(``apply_context_parallel``); and its ring attention needs an attention backend that returns the
log-sum-exp, which the default (``native``) does not, so on GPUs the exact self-attention of a ring
run gets ``_native_cudnn``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fp4vis.services.runtime import resolve_device
from fp4vis.services.usage import UsageError

OPTION = "--cp"
_PART = re.compile(r"^\s*(ulysses|ring)\s*=\s*(\S+?)\s*$")
RING_EXACT_BACKEND = "_native_cudnn"   # a diffusers backend whose ring attention works (it returns the LSE)


@dataclass(frozen=True)
class ContextParallel:
    """Degrees of context parallelism: ``ulysses`` (all-to-all over heads), ``ring`` (key shards passed
    round), both (``ulysses * ring`` ranks)."""

    ulysses: int = 1
    ring: int = 1

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring

    def __str__(self) -> str:
        return ",".join(f"{n}={d}" for n, d in (("ulysses", self.ulysses), ("ring", self.ring)) if d > 1)

    def config(self):
        """diffusers' ``ContextParallelConfig`` of these degrees."""
        from diffusers import ContextParallelConfig

        return ContextParallelConfig(ulysses_degree=self.ulysses, ring_degree=self.ring)

    def to_dict(self) -> dict[str, int]:
        return {"ulysses": self.ulysses, "ring": self.ring, "world_size": self.degree}


def parse_cp(text: str, option: str = OPTION) -> ContextParallel:
    """``"ulysses=2"``, ``"ring=4"``, ``"ulysses=2,ring=2"`` -> ContextParallel; UsageError naming the option."""
    form = "ulysses=N, ring=N or both (e.g. ulysses=2,ring=2)"
    degrees: dict[str, int] = {}
    for part in str(text).split(","):
        m = _PART.match(part)
        if m is None:
            raise UsageError(f"{option}: expected {form}, got {text!r}")
        name, value = m.groups()
        if name in degrees:
            raise UsageError(f"{option}: {name} given twice in {text!r}")
        try:
            degrees[name] = int(value)
        except ValueError:
            raise UsageError(f"{option}: {name} must be a whole number of GPUs, got {value!r}") from None
        if degrees[name] < 1:
            raise UsageError(f"{option}: {name} must be at least 1, got {degrees[name]}")
    cp = ContextParallel(**degrees)
    if cp.degree == 1:
        raise UsageError(f"{option}: {text!r} is one rank; give ulysses or ring a degree of 2 or more "
                         f"(or leave {option} out)")
    return cp


# ------------------------------------------------------------------------------------------------
# the process group


@dataclass(frozen=True)
class Session:
    """This process's place in a distributed run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from the environment torchrun sets; None outside torchrun."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def is_main_process() -> bool:
    """True on rank 0 of a distributed run and outside one: the process that writes results."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    env = torchrun_env()
    return env is None or env[0] == 0


@contextlib.contextmanager
def distributed(cp: ContextParallel, device: str | torch.device = "auto", option: str = OPTION) -> Iterator[Session]:
    """The process group of a torchrun launch, for a run of ``cp``'s degree: initialised from
    torchrun's environment (NCCL on CUDA, gloo on the CPU) unless the caller already did, and destroyed
    at the end if initialised here. Each rank takes the GPU of its LOCAL_RANK. A rank that ends its work
    waits at a barrier for the others before the group is destroyed: rank 0 decodes and writes after the
    others are done, and a rank tearing its connections down while another still runs can abort a gloo
    process at exit. A rank that raises skips the barrier (torchrun stops the others)."""
    import torch.distributed as dist

    env = torchrun_env()
    if env is None and not dist.is_initialized():
        raise UsageError(f"{option} {cp}: needs {cp.degree} processes, one per GPU; launch with torchrun "
                         f"--nproc-per-node {cp.degree} -m fp4vis.cli ... {option} {cp}")
    rank, world, local_rank = env if env is not None else (dist.get_rank(), dist.get_world_size(), dist.get_rank())
    if world != cp.degree:
        raise UsageError(f"{option} {cp}: needs {cp.degree} processes (ulysses x ring), but torchrun started "
                         f"{world}; use --nproc-per-node {cp.degree}")
    dev = _rank_device(device, local_rank, option)
    owner = not dist.is_initialized()
    if owner:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
    try:
        yield Session(rank=rank, world_size=world, local_rank=local_rank, device=dev)
        if owner:
            dist.barrier()
    finally:
        if owner and dist.is_initialized():
            dist.destroy_process_group()


def _rank_device(device: str | torch.device, local_rank: int, option: str) -> torch.device:
    dev = resolve_device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is not None and str(device) not in ("auto", "cuda"):
        raise UsageError(f"--device {device}: under {option} each rank takes the GPU of its LOCAL_RANK; "
                         "use --device cuda or auto")
    if local_rank >= torch.cuda.device_count():
        raise UsageError(f"{option}: rank {local_rank} has no GPU ({torch.cuda.device_count()} visible); start "
                         "at most one process per GPU")
    return torch.device("cuda", local_rank)


def gathered(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (a one-element list outside a process group): what the benchmarks
    record per rank."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def agree(check) -> Any:
    """Run ``check()`` on rank 0 only (it may write, e.g. probe an output folder) and raise its
    UsageError on every rank, so that all ranks stop together before any work."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return check()
    box: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            box[0] = check()
        except UsageError as exc:
            box[1] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise UsageError(box[1])
    return box[0]


# ------------------------------------------------------------------------------------------------
# the transformer


def check_heads(num_heads: int, cp: ContextParallel, option: str = OPTION) -> None:
    if num_heads % cp.ulysses:
        raise UsageError(f"{option} {cp}: ulysses={cp.ulysses} does not divide the transformer's {num_heads} heads "
                         "(Ulysses gives each rank whole heads); use a ulysses degree that divides "
                         f"{num_heads}, or ring")


def check_tokens(tokens: int, cp: ContextParallel, option: str = OPTION) -> None:
    """diffusers splits the sequence into ``cp.degree`` equal shards."""
    if tokens % cp.degree:
        raise UsageError(f"{option} {cp}: the video's {tokens} tokens do not split into {cp.degree} equal shards "
                         "(diffusers' context parallelism needs equal shards); choose a size whose token count "
                         f"(frames, height, width after the VAE and patching) is divisible by {cp.degree}")


SHARD_ASSERTION = "must be divisible by mesh size"   # diffusers' EquipartitionSharder, on an unequal split


@contextlib.contextmanager
def equal_shards(cp: ContextParallel | None, option: str = OPTION) -> Iterator[None]:
    """diffusers' split of a sequence into unequal shards (an AssertionError of its sharder, at the first
    transformer pass, on every rank alike) as a UsageError naming ``option``; nothing without ``cp``."""
    try:
        yield
    except AssertionError as exc:
        if cp is None or SHARD_ASSERTION not in str(exc):
            raise
        raise UsageError(f"{option} {cp}: a sequence the transformer splits (the image or video tokens at this size, "
                         f"or the prompt's tokens) does not split into {cp.degree} equal shards (diffusers' context "
                         "parallelism needs equal shards); choose a size, or a prompt length, that divides") from None


def ring_exact_backend(device: torch.device, dtype: torch.dtype) -> str | None:
    """The diffusers attention backend that runs exact attention under ring parallelism here, or None
    where none of diffusers' backends can (its ring merges partial outputs by their log-sum-exp, which
    the native backend does not return; cuDNN does, on CUDA in FP16/BF16)."""
    return RING_EXACT_BACKEND if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) else None


def check_exact_under_ring(cp: ContextParallel, device: torch.device, dtype: torch.dtype, exact: str | None,
                           option: str = OPTION) -> None:
    """``exact``: what would run exact self-attention (e.g. "--policy bf16"), None when nothing does."""
    if cp.ring > 1 and exact and ring_exact_backend(device, dtype) is None:
        raise UsageError(f"{option} {cp}: {exact} runs exact attention through diffusers' ring attention, which "
                         f"needs a backend that returns the log-sum-exp: none of diffusers' does on {device.type} "
                         f"in {str(dtype).removeprefix('torch.')}; use ulysses, or FP4 attention on every step")


def enable_context_parallel(transformer: torch.nn.Module, cp: ContextParallel, option: str = OPTION, *,
                            exact_backend_for_ring: bool = True) -> None:
    """diffusers' context parallelism on ``transformer`` (module docstring), after the checks that
    would otherwise fail inside the first forward. With ``ring`` and ``exact_backend_for_ring``, the
    self-attention layers that use diffusers' default backend get ``ring_exact_backend`` for their
    exact attention (cross-attention is local under context parallelism and keeps its backend)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError(f"{option} {cp}: no process group (launch with torchrun, or initialise one)")
    if dist.get_world_size() != cp.degree:
        raise UsageError(f"{option} {cp}: needs {cp.degree} processes, the process group has {dist.get_world_size()}")
    check_heads(int(transformer.config.num_attention_heads), cp, option)
    if getattr(transformer, "_cp_plan", None) is None:
        raise UsageError(f"{option} {cp}: diffusers has no context-parallel plan for {type(transformer).__name__} "
                         "(its _cp_plan: where the sequence is split and gathered), so its context parallelism cannot "
                         "run it; run it on one process")
    param = next(transformer.parameters())
    backend = ring_exact_backend(param.device, param.dtype)
    if cp.ring > 1 and backend is not None and exact_backend_for_ring:
        _set_self_attention_backend(transformer, backend)
    if torch.accelerator.device_count() > 0:
        transformer.enable_parallelism(config=cp.config())
    else:
        enable_without_accelerator(transformer, cp.config())


def _set_self_attention_backend(model: torch.nn.Module, backend: str) -> None:
    """What ``ModelMixin.set_attention_backend`` records, on the self-attention processors that use the
    default backend only."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    for module in model.modules():
        processor = getattr(module, "processor", None)
        if (processor is not None and hasattr(processor, "_attention_backend")
                and not getattr(module, "is_cross_attention", False) and processor._attention_backend is None):
            processor._attention_backend = AttentionBackendName(backend)


def enable_without_accelerator(model: torch.nn.Module, cp_config: Any) -> None:
    """``ModelMixin.enable_parallelism`` for context parallelism, step by step, on a CPU-only machine
    (diffusers 0.42 computes ``rank % torch.accelerator.device_count()`` there, a division by zero):
    the device mesh on the CPU, the config recorded on the model and its attention processors, the
    model's split/gather hooks (``_cp_plan``)."""
    import torch.distributed as dist
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    if getattr(model, "_parallel_config", None) is not None:
        raise RuntimeError(f"parallelism is already applied to this {type(model).__name__}")
    config = ParallelConfig(context_parallel_config=cp_config)
    mesh = init_device_mesh("cpu", cp_config.mesh_shape, mesh_dim_names=cp_config.mesh_dim_names)
    config.setup(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), mesh=mesh)
    model._parallel_config = config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(model, cp_config, model._cp_plan)

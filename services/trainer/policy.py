"""The policy being trained: LoRA adapters (through ``peft``) on the gen path, or every gen-path
(``moe_gen``) parameter, with the und path frozen either way (but in ``flowgrpo sft`` with
``policy.text``, which trains the language half too, as a model trained from scratch needs).

Trainable parameters are fp32 (master weights and optimizer state); the frozen weights stay in
the load dtype. ``published`` gives what changed, in the policy-update naming that rollouts
load; ``reference()`` runs a forward with the reference policy for the KL term (adapters
disabled for LoRA, a frozen copy of the gen path for full training, kept only when asked for);
``old()`` runs one with DiffusionNFT's old (sampling) policy, an fp32 average of the trainable
tensors swapped in place (LoRA and full alike: one mechanism, sharded like the parameters).

The policy may be built on the meta device and sharded before any weight exists
(``services/trainer/load.py``); ``init_adapters`` and ``keep_reference`` then run once the
weights are loaded. LoRA A is drawn per tensor from a generator seeded by ``init_seed`` and the
tensor's name, never from the global generator: the initial adapter is the same for any number
of processes, any sharding and any target order.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from flowgrpo.bus.cuda_ipc import BucketWriter
from flowgrpo.configs.trainer import PolicyConfig
from flowgrpo.models.bagel.config import is_gen_path, is_text_path
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.policy import LORA_A, LORA_B
from flowgrpo.services.trainer.distributed import full_tensor, local_tensor, shard_like

ADAPTER = "default"


class TrainablePolicy:
    """Wraps a loaded BAGEL model: marks what trains, names what is published."""

    def __init__(self, model: BagelModel, config: PolicyConfig, keep_reference: bool = False) -> None:
        self.config = config
        self.kind = config.kind
        for p in model.parameters():
            p.requires_grad_(False)
        # LoRA adapters are injected in place: the policy's model stays the BagelModel
        self.model = (
            _add_lora(model, config)
            if config.kind == "lora"
            else _unfreeze_gen_path(model, config.heads, config.text)
        )
        self._reference: dict[str, Tensor] | None = None
        self._old: dict[str, Tensor] | None = None  # the old copy (keep_old): NFT's old policy, AWM's average
        # trainer.share_base: the allocation every frozen weight is a view of (load.py)
        self.base_bucket: BucketWriter | None = None
        if not model.vae2llm.weight.is_meta:
            self.init_adapters()
            if keep_reference:
                self.keep_reference()

    def init_adapters(self) -> None:
        """LoRA: A drawn from (``init_seed``, its name) — gaussian std 1/r, or peft's default
        uniform(+-1/sqrt(in)) for ``zero_b`` — and B = 0, so training starts at the base policy."""
        if self.kind != "lora":
            return
        with torch.no_grad():
            for name, param in self.trainable().items():
                full = torch.zeros(param.shape, dtype=torch.float32)
                if ".lora_A." in name:
                    # the CPU generator keeps 32 bits of its seed: hash seed and name into them
                    key = hashlib.sha256(f"{self.config.init_seed}/{name}".encode()).digest()
                    generator = torch.Generator().manual_seed(int.from_bytes(key[:4], "little"))
                    if self.config.lora_init == "gaussian":
                        full.normal_(0.0, 1.0 / self.config.lora_rank, generator=generator)
                    else:
                        bound = 1.0 / math.sqrt(param.shape[1])
                        full.uniform_(-bound, bound, generator=generator)
                param.copy_(shard_like(param, full))

    def keep_reference(self) -> None:
        """Full training: keep the gen path as it is now (the loaded weights) for the KL term,
        in the frozen weights' dtype (lossless: they were loaded in it) and sharded like the
        parameters. LoRA needs no copy: its reference is the model with adapters disabled."""
        if self.kind == "full":
            dtype = self.model.vae2llm.weight.dtype
            self._reference = {
                n: local_tensor(p).detach().to(dtype, copy=True) for n, p in self.trainable().items()
            }

    def trainable(self) -> dict[str, nn.Parameter]:
        """The trained parameters (sharded DTensors under FSDP2)."""
        # FSDP2's root keeps its gathered parameters registered after a forward (no re-gather for
        # the next one): reshard, so what is listed here is always the sharded state
        self._reshard()
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def published(self) -> dict[str, Tensor]:
        """The trainable tensors, whole, under their published names (LoRA: ``<module>.lora_A.weight``)."""
        return dict(self.iter_published())

    def iter_published(self) -> Iterator[tuple[str, Tensor]]:
        """``published()`` one tensor at a time: under FSDP each is gathered when reached (a
        collective: every rank iterates), so one whole tensor exists at a time, not the gen path."""
        for name, param in self.trainable().items():
            yield self.published_name(name), full_tensor(param.detach())

    def published_specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """Names, whole shapes and dtypes of the published tensors, without gathering anything."""
        return [(self.published_name(n), p.shape, p.dtype) for n, p in self.trainable().items()]

    def published_name(self, param_name: str) -> str:
        return lora_published_name(param_name) if self.kind == "lora" else param_name

    def load_published(self, tensors: dict[str, Tensor]) -> None:
        """Set the trainable tensors from their published form (checkpoint resume)."""
        by_name = {self.published_name(n): p for n, p in self.trainable().items()}
        missing, unknown = sorted(set(by_name) - set(tensors)), sorted(set(tensors) - set(by_name))
        if missing or unknown:
            raise ValueError(
                f"trainable tensors do not match: missing {missing[:5]}, unexpected {unknown[:5]}"
            )
        with torch.no_grad():
            for name, param in by_name.items():
                param.copy_(shard_like(param, tensors[name]))

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Forwards inside run the reference policy (no gradient flows to it)."""
        if self.kind == "lora":
            from peft.tuners.tuners_utils import BaseTunerLayer  # a LoRA policy imported peft already

            layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
            for layer in layers:
                layer.enable_adapters(False)
            try:
                yield
            finally:
                for layer in layers:
                    layer.enable_adapters(True)
            return
        if self._reference is None:
            raise RuntimeError(
                "full training has no KL reference: build the policy with keep_reference=True "
                "(the trainer does when trainer.loss.kl_beta > 0)"
            )
        with self._swapped(self._reference):
            yield

    # --- the old copy: DiffusionNFT's old (sampling) policy, AWM's average of past policies ------

    def keep_old(self) -> None:
        """The old policy starts as the trainable tensors are now; it is an average of them, so
        it is kept in fp32, sharded like them (a DTensor under FSDP2: checkpoints save it so)."""
        self._old = {n: p.detach().clone().float() for n, p in self.trainable().items()}

    def old_state(self) -> dict[str, Tensor]:
        if self._old is None:
            raise RuntimeError("this policy keeps no old policy (keep_old was not called)")
        return self._old

    @contextlib.contextmanager
    def old(self) -> Iterator[None]:
        """Forwards (and publications) inside run the old policy."""
        with self._swapped({n: local_tensor(t) for n, t in self.old_state().items()}):
            yield

    @torch.no_grad()
    def refresh_old(self, decay: float) -> None:
        """old <- decay old + (1 - decay) current, on each rank's shards."""
        for name, param in self.trainable().items():
            old = local_tensor(self.old_state()[name])
            old.mul_(decay).add_(local_tensor(param).float(), alpha=1.0 - decay)

    @contextlib.contextmanager
    def _swapped(self, values: dict[str, Tensor]) -> Iterator[None]:
        """The trainable tensors set to ``values`` (this rank's shards) inside, restored after."""
        params = {n: local_tensor(p) for n, p in self.trainable().items()}  # this rank's shards
        current = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(values[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(current[n])
            self._reshard()  # drop the root's gathered weights: the next forward regathers

    def _reshard(self) -> None:
        reshard = getattr(self.model, "reshard", None)  # an FSDP2 module
        if reshard is not None:
            reshard()


def lora_published_name(param_name: str) -> str:
    """``<module>.lora_A.default.weight`` (peft) -> ``<module>.lora_A.weight`` (published)."""
    for part, suffix in ((".lora_A.", LORA_A), (".lora_B.", LORA_B)):
        if part in param_name:
            return param_name.split(part, maxsplit=1)[0] + suffix
    raise ValueError(f"{param_name} is not a LoRA parameter")


def _add_lora(model: BagelModel, config: PolicyConfig) -> BagelModel:
    # peft (and the transformers it imports) only for LoRA: ~4 s of every full-policy trainer's start
    from peft import LoraConfig, inject_adapter_in_model

    names = [n for n, _ in model.named_modules()]
    unmatched = [t for t in config.lora_targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"trainer.policy.lora_targets {unmatched} match no module of the model")
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,  # type: ignore[arg-type]  # peft says int; alpha / r takes any real
        target_modules=list(config.lora_targets),
        lora_dropout=0.0,
        init_lora_weights="gaussian" if config.lora_init == "gaussian" else True,
    )
    with torch.random.fork_rng(devices=[]):  # peft's own init draws from the global generator
        inject_adapter_in_model(lora, model, adapter_name=ADAPTER)  # in place
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.data = param.data.float()  # fp32 trainable weights and optimizer state
            param.requires_grad_(True)
    return model


# the generation heads: what maps latents in and out of the gen path and embeds the time
HEADS = ("vae2llm.", "llm2vae.", "time_embedder.")


def _unfreeze_gen_path(model: BagelModel, heads: bool = False, text: bool = False) -> BagelModel:
    for name, param in model.named_parameters():
        if is_gen_path(name) or (heads and name.startswith(HEADS)) or (text and is_text_path(name)):
            param.data = param.data.float()
            param.requires_grad_(True)
    return model

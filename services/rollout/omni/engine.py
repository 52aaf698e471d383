"""``VllmOmniBagelEngine``: the rollout engine on vLLM-Omni's BAGEL pipeline.

One vLLM-Omni ``Omni`` instance (single-stage BAGEL deploy) runs
:class:`~flowgrpo.services.rollout.omni.pipeline.FlowGrpoBagelPipeline`; every sample is one
request (BAGEL's pipeline samples one prompt per forward), carrying its coordinates and the
sampler settings in ``extra_args``. The trajectory vLLM-Omni returns (every step's latent and the
window's log-probs) is cut into the rollout's sample format here.

Policy updates are checked whole against the checkpoint's parameter names and shapes (the
native engine's checks), turned into gen-path tensors under the published names (a LoRA update is
merged onto the base weights, as the native engine's merge mode computes it), staged to a
safetensors file and loaded by the worker extension:

- ``in_place``: ``pipeline.load_weights`` in the worker, name by name, failing on any name vLLM-Omni
  drops (verl-omni's route; the GPU path);
- ``reload``: a staged copy of the checkpoint folder with the updated ``ema.safetensors``, and the
  pipeline rebuilt from it. vLLM's CPU linears are prepacked and drop their weight loaders, so on a
  CPU this is the path that works (seconds for the tiny model; never for a 7B).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from flowgrpo.models.bagel.checkpoint import EMA_FILE, read_bagel_config
from flowgrpo.models.bagel.model import BagelModel
from flowgrpo.models.bagel.policy import PolicyUpdate, PolicyUpdateError, check_update, merge_lora
from flowgrpo.models.bagel.sampling import SampleRequest, Trajectories
from flowgrpo.sampler_math import shifted_schedule, window_begin
from flowgrpo.sampler_params import SamplerParams
from flowgrpo.services.rollout.omni.request import OmniSampleRequest

log = logging.getLogger(__name__)

WeightSync = Literal["auto", "in_place", "reload"]
DEPLOY_FILE = "deploy/bagel_single_stage.yaml"  # inside the vllm_omni package


class VllmOmniError(RuntimeError):
    """vLLM-Omni failed a request or a weight load; the replica's state is unknown: restart it."""


class VllmOmniBagelEngine:
    """A ``RolloutEngine`` on vLLM-Omni. Build it with :meth:`from_checkpoint`."""

    def __init__(
        self, omni: Any, checkpoint: Path, *, dtype: torch.dtype, weight_sync: WeightSync, staging: Path
    ) -> None:
        self.omni = omni
        self.checkpoint = checkpoint
        self.dtype = dtype
        self.weight_sync = weight_sync
        self.staging = staging
        self._version = 0
        with torch.device("meta"):  # names and shapes for the update checks; no memory
            self._params = dict(BagelModel(read_bagel_config(checkpoint)).named_parameters())
        self._base: dict[str, Tensor] = {}  # published name -> base weight (dtype), read when first needed
        self._changed: dict[str, Tensor] = {}  # reload only: published name -> weight, where not the base
        self._merged: set[str] = set()  # modules holding a merged LoRA

    @classmethod
    def from_checkpoint(
        cls,
        folder: str | Path,
        *,
        device: str,
        dtype: torch.dtype,
        weight_sync: WeightSync = "auto",
        deploy_config: str = "",
    ) -> VllmOmniBagelEngine:
        try:
            import vllm_omni
            from vllm_omni.entrypoints.omni import Omni
        except ImportError as error:
            raise RuntimeError(
                f"rollout.engine=vllm_omni needs vLLM-Omni installed beside flowgrpo ({error}); "
                "see docs/rollout-engines.md, or use rollout.engine=native"
            ) from error
        from flowgrpo.services.rollout.omni.pipeline import PIPELINE_CLASS, WORKER_EXTENSION_CLASS

        if dtype != torch.bfloat16:
            raise ValueError(
                f"vLLM-Omni's BAGEL samples in bfloat16 only, not {dtype}: set rollout.dtype=bfloat16"
            )
        if weight_sync == "auto":
            weight_sync = "reload" if device == "cpu" else "in_place"
        staging = Path(tempfile.mkdtemp(prefix="flowgrpo-vllm-omni-"))
        try:
            deploy = deploy_config or str(
                _deploy_for(device, Path(vllm_omni.__file__).parent / DEPLOY_FILE, staging)
            )
            omni = Omni(
                model=str(Path(folder).resolve()),
                deploy_config=deploy,
                dtype="bfloat16",
                custom_pipeline_args={"pipeline_class": PIPELINE_CLASS},
                worker_extension_cls=WORKER_EXTENSION_CLASS,
            )
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info(
            "vLLM-Omni %s serves BAGEL from %s on %s (weights: %s)",
            vllm_omni.__version__,
            folder,
            device,
            weight_sync,
        )
        return cls(omni, Path(folder).resolve(), dtype=dtype, weight_sync=weight_sync, staging=staging)

    @property
    def policy_version(self) -> int:
        return self._version

    # --- sampling --------------------------------------------------------------------------------

    def generate(
        self,
        requests: Sequence[SampleRequest],
        params: SamplerParams,
        *,
        seed: int,
        step: int,
        between_steps: Callable[[], None] | None = None,
    ) -> Trajectories:
        """One vLLM-Omni request per sample (``between_steps`` runs before each: a stop lands
        between two samples, not two denoising steps)."""
        params.check("sampler")
        if not requests:
            raise ValueError("generate() needs at least one request")
        wire = params.to_proto().SerializeToString()
        rows = []
        for request in requests:
            if between_steps is not None:
                between_steps()
            begin = window_begin(params, seed, step, request.prompt_uid)
            sample = OmniSampleRequest(
                prompt_ids=tuple(int(i) for i in request.prompt_ids.tolist()),
                prompt_uid=request.prompt_uid,
                sample_index=request.sample_index,
                seed=seed,
                step=step,
                window_begin=begin,
                params=wire,
            )
            rows.append(self._sample(sample, params))
        return _stack(rows, params)

    def _sample(self, request: OmniSampleRequest, params: SamplerParams) -> dict[str, Any]:
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        sampling = OmniDiffusionSamplingParams(
            height=params.height,
            width=params.width,
            num_inference_steps=params.num_points,  # vLLM-Omni's BAGEL: n schedule points, n - 1 steps
            return_trajectory_latents=True,
            extra_args=request.extra_args(),
        )
        (output,) = self.omni.generate([{"prompt": request.prompt_uid}], [sampling], use_tqdm=False)
        if output.error:
            raise VllmOmniError(
                f"vLLM-Omni failed sample {request.sample_index} of {request.prompt_uid!r}: {output.error}"
            )
        trajectory = output.multimodal_output.get("trajectory") or {}
        latents, log_probs = trajectory.get("latents"), trajectory.get("log_probs")
        expected = (params.num_points, params.window_size)
        got = (
            None if latents is None else latents.shape[0],
            None if log_probs is None else log_probs.shape[0],
        )
        if latents is None or log_probs is None or got != expected:
            raise VllmOmniError(
                f"vLLM-Omni returned (latents, log-probs) for {got} steps, expected {expected}: "
                "is the FlowGRPO pipeline the one serving?"
            )
        image = torch.from_numpy(np.array(output.images[0].convert("RGB"))) if params.decode_images else None
        return {
            "begin": request.window_begin,
            "latents": latents.float().cpu(),
            "log_probs": log_probs.float().cpu(),
            "image": image,
        }

    # --- policy updates ----------------------------------------------------------------------------

    def apply_update(self, update: PolicyUpdate) -> None:
        """Check, compute the gen-path tensors that change, load them; the engine's bookkeeping
        moves to the new version only once vLLM-Omni has them (a failed load raises VllmOmniError:
        the pipeline may hold part of the update, so the replica must be restarted)."""
        pairs = check_update(update, self._params, self._version)
        if update.kind == "gen_path":
            if self._merged & {n.removesuffix(".weight") for n in update.tensors}:
                raise PolicyUpdateError(
                    "a gen_path update touches LoRA-merged weights; use one update kind per run"
                )
            changed = {name: t.to("cpu", self.dtype).contiguous() for name, t in update.tensors.items()}
            holds = {**self._changed, **changed}
        else:
            changed = {m + ".weight": self._base_weight(m) for m in self._merged - set(pairs)}  # back to base
            for module, (a, b) in pairs.items():
                changed[module + ".weight"] = merge_lora(
                    self._base_weight(module), a.cpu(), b.cpu(), update.lora_scale
                )
            holds = {n: t for n, t in changed.items() if n.removesuffix(".weight") in pairs}
        if self.weight_sync == "in_place":
            self._load_in_place(update.version, changed)
        else:
            self._reload(update.version, holds)
            self._changed = holds  # only a reload needs every changed tensor again
        if update.kind == "lora":
            self._merged = set(pairs)
        self._version = update.version

    def _base_weight(self, module: str) -> Tensor:
        name = module + ".weight"
        if name not in self._base:
            with safe_open(str(self.checkpoint / EMA_FILE), framework="pt") as f:
                self._base[name] = f.get_tensor(name).to(self.dtype)
        return self._base[name]

    def _load_in_place(self, version: int, tensors: dict[str, Tensor]) -> None:
        path = self.staging / f"update-v{version}.safetensors"
        save_file(tensors, str(path))
        try:
            self._rpc("flowgrpo_load_weights", str(path))
        finally:
            path.unlink(missing_ok=True)

    def _reload(self, version: int, holds: dict[str, Tensor]) -> None:
        """A staged copy of the checkpoint (links to every file but ``ema.safetensors``, which is
        the base with ``holds``, every tensor that is not the base's), and the pipeline rebuilt
        from it."""
        folder = self.staging / f"v{version}"
        folder.mkdir()
        for item in self.checkpoint.iterdir():
            if item.name != EMA_FILE:
                (folder / item.name).symlink_to(item)
        with safe_open(str(self.checkpoint / EMA_FILE), framework="pt") as f:
            tensors = {name: holds.get(name, f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118
        save_file(tensors, str(folder / EMA_FILE))
        self._rpc("flowgrpo_reload", str(folder))
        for old in self.staging.glob("v*"):
            if old != folder:
                shutil.rmtree(old)

    def _rpc(self, method: str, *args: Any) -> None:
        results = self.omni.engine.collective_rpc(method, args=args, stage_ids=[0])
        failed = [r["error"] for r in results if isinstance(r, dict) and r.get("error")]
        if failed:
            raise VllmOmniError(f"vLLM-Omni's worker failed {method}: {'; '.join(map(str, failed))}")

    def close(self) -> None:
        self.omni.close()
        shutil.rmtree(self.staging, ignore_errors=True)


def _deploy_for(device: str, stock: Path, staging: Path) -> Path:
    """vLLM-Omni's single-stage BAGEL deploy with the stage on ``device``'s GPU ("cuda:N")."""
    config = yaml.safe_load(stock.read_text())
    if device.startswith("cuda"):
        index = device.partition(":")[2] or "0"
        for stage in config["stages"]:
            stage["devices"] = index
    elif device != "cpu":
        raise ValueError(f"rollout.device={device!r}: vLLM-Omni runs on 'cpu', 'cuda' or 'cuda:N'")
    path = staging / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _stack(rows: list[dict[str, Any]], params: SamplerParams) -> Trajectories:
    """The per-sample trajectories cut to the window and stacked into the rollout's format."""
    size = params.window_size
    schedule = shifted_schedule(params.num_points, params.timestep_shift)
    begins = torch.tensor([r["begin"] for r in rows], dtype=torch.long)
    steps = begins[:, None] + torch.arange(size + 1)
    images = [r["image"] for r in rows]
    return Trajectories(
        latents=torch.stack(
            [r["latents"][b : b + size + 1] for r, b in zip(rows, begins.tolist(), strict=True)]
        ),
        log_probs=torch.stack([r["log_probs"] for r in rows]),
        sigmas=schedule[steps],
        timesteps=steps[:, :-1],
        window_begin=begins,
        final_latents=torch.stack([r["latents"][-1] for r in rows]),
        images=None if any(i is None for i in images) else torch.stack(images),
    )

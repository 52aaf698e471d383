"""The run configuration: one typed config for a whole training job, split into the part each
service reads (``rollout``, ``reward``, ``trainer`` — the same sections ``flowgrpo serve ROLE``
takes) and the coordinator's own (data, sampling, advantages, schedule, launch).

Loaded from a recipe (``examples/*.yaml``) with dotted overrides
(``flowgrpo train RECIPE trainer.optim.lr=1e-4``), validated before anything starts; the resolved
config is written to ``<run_dir>/config.yaml``. Torch-free: the coordinator imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from flowgrpo.algorithms import algorithm_of
from flowgrpo.bus.config import BusConfig
from flowgrpo.config import ConfigError, from_dict, load_config
from flowgrpo.configs.publication import PublicationConfig
from flowgrpo.configs.reward import StreamConfig
from flowgrpo.configs.rollout import EngineConfig
from flowgrpo.configs.trainer import TrainerConfig, upgraded_trainer
from flowgrpo.fields import SEED_MAX, check_int, knob
from flowgrpo.models.bagel.config import GEN_PATH_LINEARS
from flowgrpo.rewards.config import RewardConfig
from flowgrpo.runtime.config import ServerConfig
from flowgrpo.sampler_params import MAX_NUM_POINTS, MAX_SIDE, SamplerParams, SamplerSettings
from flowgrpo.yamlfile import YamlError, read_yaml_file

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")  # a torch device string as the services take it


@dataclass
class ModelConfig:
    # BAGEL folder in the published layout; empty: a tiny random BAGEL is made in <run_dir>/model
    checkpoint: str = ""
    tiny_seed: int = knob(0, 0, SEED_MAX)  # the tiny model's weights


@dataclass
class DataConfig:
    dataset: str = ""  # folder written by `flowgrpo data prepare` (train.parquet, test.parquet, meta.json)
    # or: a folder of train.txt / test.txt, prepared into <run_dir>/data with the run's tokenizer
    prompts: str = ""
    kind: Literal["pickscore", "ocr", "compose"] = "pickscore"  # how `prompts` are prepared (data.md)
    prompts_per_step: int = knob(48, 1, 1_000_000)  # prompt groups per training step
    group_size: int = knob(16, 1, 100_000)  # G: samples per prompt
    val_prompts: int = knob(16, 0, 1_000_000)  # a fixed subset of the test split, scored at every validation
    # images per validation prompt, each with its own fixed noise: mean@1 is the first's (comparable
    # whatever this is), mean@N all N's (a standard error about sqrt(N) times smaller)
    val_samples: int = knob(1, 1, 1024)

    def validate(self) -> None:
        if bool(self.dataset) == bool(self.prompts):
            raise ValueError(
                "set exactly one of data.dataset (a folder from `flowgrpo data prepare`) and data.prompts "
                "(a folder of train.txt / test.txt, prepared when the run starts)"
            )
        if self.prompts_per_step < 1:
            raise ValueError(f"data.prompts_per_step={self.prompts_per_step} must be >= 1")
        if self.group_size < 2:
            raise ValueError(
                f"data.group_size={self.group_size}: group advantages need >= 2 samples per prompt "
                "(a group of one always gets advantage 0 and trains nothing)"
            )
        if self.val_prompts < 0:
            raise ValueError(f"data.val_prompts={self.val_prompts} must be >= 0")
        if not 1 <= self.val_samples <= 1024:
            raise ValueError(f"data.val_samples={self.val_samples} must be in [1, 1024]")


@dataclass(frozen=True)
class SamplingConfig(SamplerSettings):
    """The sampler settings of training rollouts (every knob is :class:`SamplerSettings`'s),
    their image size, and the schedule of validation, which samples with the ODE (noise 0)."""

    resolution: int = knob(512, 16, MAX_SIDE)  # pixels, square; a multiple of 16
    eval_num_points: int = knob(50, 2, MAX_NUM_POINTS)

    def validate(self) -> None:
        self.check("sampling")
        check_int("sampling.eval_num_points", self.eval_num_points, 2, MAX_NUM_POINTS)
        if self.resolution <= 0 or self.resolution % 16:
            raise ValueError(f"sampling.resolution={self.resolution} must be a positive multiple of 16")

    def params(self, evaluation: bool = False) -> SamplerParams:
        """Training rollouts, or validation ones (ODE, ``eval_num_points``, no window, and each
        sample's own initial noise: unbranched, so validation images do not depend on ``branch``)."""
        settings = {f.name: getattr(self, f.name) for f in fields(SamplerSettings)}
        if evaluation:
            points = self.eval_num_points
            settings |= {"num_points": points, "noise_level": 0.0, "window_size": 1, "branch": False,
                         "window_range": (0, points - 1), "window_strategy": "fixed"}  # fmt: skip
        return SamplerParams(**settings, height=self.resolution, width=self.resolution)


@dataclass
class AdvantageConfig:
    """Group advantages A = (r - mean_group) / (std_group + eps), clipped."""

    std_ddof: Literal[0, 1] = 1  # 1: torch.std as verl-omni; 0: np.std as flow_grpo
    eps: float = knob(1e-4, 1e-12, 1.0)
    clip: float = knob(5.0, 0.0, 1e6)
    global_std: bool = False  # the std of the whole step's rewards instead of each group's

    def validate(self) -> None:
        if self.eps <= 0 or self.clip <= 0:
            raise ValueError("advantages.eps and advantages.clip must be > 0")


@dataclass
class ScheduleConfig:
    mode: Literal["sync", "async"] = "sync"
    staleness: int = knob(1, 0, 1_000_000)  # async: eta, the largest policy lag a trained sample may have
    steps: int = knob(300, 1, 10**9)
    save_every: int = knob(30, 0, 10**9)  # trainer + run-state checkpoints; 0: only at the end
    eval_every: int = knob(30, 0, 10**9)  # validation on the fixed subset; 0: never
    seed: int = knob(0, 0, SEED_MAX)  # the run seed: noise, windows and the dataset order are functions of it

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"schedule.steps={self.steps} must be >= 1")
        if self.staleness < 0:
            raise ValueError(f"schedule.staleness={self.staleness} must be >= 0 (0 reproduces sync)")
        if self.save_every < 0 or self.eval_every < 0:
            raise ValueError("schedule.save_every and schedule.eval_every must be >= 0")


@dataclass
class LaunchConfig:
    """How the services run. ``local``: each its own process on loopback (free ports);
    ``inprocess``: all four as actors in this process, no sockets; ``remote``: already running
    (``flowgrpo serve ROLE``, compose, Kubernetes), at the given addresses or, without addresses,
    as they register with this coordinator (``coordinator=HOST:PORT`` in their configs)."""

    launcher: Literal["local", "inprocess", "remote"] = "local"
    rollout_replicas: int = knob(1, 1, 100_000)
    reward_replicas: int = knob(1, 1, 100_000)
    trainer_nproc: int = knob(1, 1, 100_000)  # local: > 1 starts the trainer under torchrun (FSDP2)
    rollout_devices: list[str] = field(default_factory=list)  # local: one per replica ("cuda:0", ...)
    rollout_addresses: list[str] = field(default_factory=list)  # remote; empty: wait for registrations
    reward_addresses: list[str] = field(default_factory=list)  # remote
    trainer_address: str = ""  # remote
    # local: times a rollout or reward replica process that died is started again
    restarts: int = knob(3, 0, 1000)
    # times in a run a trainer that died is replaced: local starts it again, remote waits for one
    # to register (trainer_rejoin_timeout_s). It resumes from its newest complete checkpoint and
    # trains the steps since again from their kept samples; 0: a trainer's death ends the run
    trainer_restarts: int = knob(3, 0, 1000)
    # steps trained since the newest complete checkpoint whose samples stay in the rollouts'
    # stores for a restarted trainer (their memory); a death with more of them ends the run.
    # schedule.save_every=1 with trainer.async_save keeps one or two
    trainer_replay_steps: int = knob(2, 0, 1_000_000)
    # remote: how long the run waits for a trainer to come back after one died
    trainer_rejoin_timeout_s: float = knob(600.0, 0.1, 7 * 86_400.0)
    heartbeat_interval_s: float = knob(2.0, 0.001, 3600.0)  # how often registered replicas send a heartbeat
    # no heartbeat for this long: the replica is lost, its work goes elsewhere
    lost_after_s: float = knob(20.0, 0.001, 86_400.0)
    # beyond this many members x 1/heartbeat_interval_s the period grows (lost_after_s with it)
    max_heartbeats_per_s: float = knob(50.0, 0.001, 1e6)
    # how long a service may take to answer READY (or to register)
    start_timeout_s: float = knob(300.0, 0.1, 86_400.0)
    request_timeout_s: float = knob(600.0, 0.1, 7 * 86_400.0)  # one Generate / TrainStep / LoadWeights call
    # one image's score; a timed-out image is retried elsewhere
    reward_timeout_s: float = knob(120.0, 0.1, 86_400.0)

    def validate(self) -> None:
        if self.rollout_replicas < 1 or self.reward_replicas < 1 or self.trainer_nproc < 1:
            raise ValueError("launch.rollout_replicas, reward_replicas and trainer_nproc must be >= 1")
        bad = [d for d in self.rollout_devices if not _DEVICE.fullmatch(d)]
        if bad:
            raise ValueError(
                f"launch.rollout_devices {bad} are not devices: write 'cpu', 'cuda' or 'cuda:N' "
                "(one per replica, e.g. launch.rollout_devices=[cuda:2,cuda:3])"
            )
        if self.rollout_devices and len(self.rollout_devices) != self.rollout_replicas:
            raise ValueError(
                f"launch.rollout_devices has {len(self.rollout_devices)} entries for "
                f"launch.rollout_replicas={self.rollout_replicas}: give one device per replica"
            )
        given = [bool(self.rollout_addresses), bool(self.reward_addresses), bool(self.trainer_address)]
        if self.launcher == "remote" and any(given) and not all(given):
            raise ValueError(
                "launch.launcher=remote takes either all of launch.rollout_addresses, "
                "launch.reward_addresses and launch.trainer_address (host:port of running `flowgrpo "
                "serve` services) or none of them (the services register: start them with "
                "coordinator=HOST:PORT of this coordinator's server)"
            )
        if (
            self.restarts < 0
            or self.heartbeat_interval_s <= 0
            or self.lost_after_s < 2 * self.heartbeat_interval_s
            or not self.max_heartbeats_per_s > 0
        ):
            raise ValueError(
                f"launch.restarts={self.restarts} must be >= 0 and launch.lost_after_s={self.lost_after_s:g} "
                f"at least twice launch.heartbeat_interval_s={self.heartbeat_interval_s:g} (> 0), and "
                f"launch.max_heartbeats_per_s={self.max_heartbeats_per_s:g} > 0"
            )


@dataclass
class LoggerConfig:
    """Where a run's progress and metrics go beside metrics.jsonl and TensorBoard (always written)."""

    progress: Literal["auto", "bar", "lines", "none"] = "auto"  # auto: a bar on a terminal, else lines
    # the services still starting, and a step's samples drawn / scored / its training, said at most
    # this often and only of work that has run this long (a bar shows it in place); 0: never
    progress_every_s: float = knob(30.0, 0.0, 86_400.0)
    wandb: bool = (
        False  # also log to Weights & Biases (`pip install wandb`; WANDB_MODE=offline needs no network)
    )
    wandb_project: str = "flowgrpo"
    wandb_entity: str = ""  # "": your default entity
    wandb_mode: Literal["", "online", "offline"] = ""  # "": WANDB_MODE, else online


@dataclass
class RunConfig:
    name: str = "run"
    run_dir: str = ""  # default: runs/<name>
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    advantages: AdvantageConfig = field(default_factory=AdvantageConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # the coordinator's own gRPC server (registry, run status): server.host=0.0.0.0 server.port=50050
    # in a container; the default, loopback on a free port, suits the local launcher
    server: ServerConfig = field(default_factory=ServerConfig)
    # the coordinator's data-bus store (the prompt ids rollouts and the trainer fetch):
    # bus.host=0.0.0.0 bus.advertise_host=<its name> in a container
    bus: BusConfig = field(default_factory=BusConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # how weight versions reach the rollouts: a relay tree (default) or a star
    publication: PublicationConfig = field(default_factory=PublicationConfig)
    # the services' own sections; an empty `checkpoint` follows model.checkpoint
    rollout: EngineConfig = field(default_factory=EngineConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_stream: StreamConfig = field(default_factory=StreamConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def samples_per_step(self) -> int:
        return self.data.prompts_per_step * self.data.group_size

    def validate(self) -> None:
        loss = self.trainer.loss
        if self.data.prompts_per_step % loss.mini_batches:
            raise ValueError(
                f"data.prompts_per_step={self.data.prompts_per_step} is not divisible by "
                f"trainer.loss.mini_batches={loss.mini_batches}: each optimizer step takes whole "
                "prompt groups; change one of them"
            )
        if self.trainer.policy.kind == "lora":
            unknown = [t for t in self.trainer.policy.lora_targets if not _names_a_gen_linear(t)]
            if unknown:
                raise ValueError(
                    f"trainer.policy.lora_targets {unknown} match no module of BAGEL's gen path "
                    f"(linear modules: {', '.join(GEN_PATH_LINEARS)})"
                )
        if self.launch.trainer_nproc > 1 and self.trainer.device.startswith("cuda:"):
            raise ValueError(
                f"launch.trainer_nproc={self.launch.trainer_nproc} runs the trainer under torchrun, where "
                f"each rank takes the GPU of its LOCAL_RANK (cuda:0..{self.launch.trainer_nproc - 1}): "
                f"set trainer.device=cuda, not {self.trainer.device!r}"
            )
        if self.schedule.eval_every > 0 and self.data.val_prompts == 0:
            raise ValueError(
                f"schedule.eval_every={self.schedule.eval_every} validates on data.val_prompts=0 prompts: "
                "set data.val_prompts > 0, or schedule.eval_every=0 for no validation"
            )
        if self.rollout.max_request_samples < max(self.data.group_size, self.data.val_samples):
            raise ValueError(
                f"rollout.max_request_samples={self.rollout.max_request_samples} is below "
                f"data.group_size={self.data.group_size} or data.val_samples={self.data.val_samples}: a "
                "prompt's samples go in one request; raise it"
            )
        if self.schedule.mode == "async" and self.trainer.loss.logp_old == "bypass":
            raise ValueError(
                "schedule.mode=async needs trainer.loss.logp_old=recompute: the decoupled loss "
                "clips around the recomputed proximal policy"
            )
        self._validate_algorithm()
        self._validate_shared_base()
        self._validate_engine()

    def _validate_engine(self) -> None:
        if self.rollout.precision == "fp8" and self.trainer.loss.logp_old == "bypass":
            raise ValueError(
                "rollout.precision=fp8 samples another policy than the trainer's bf16 one: "
                "trainer.loss.logp_old=bypass would take its log-probs as the old policy's; use "
                "trainer.loss.logp_old=recompute (the importance ratio then corrects the mismatch)"
            )
        if self.sampling.batch_invariant and self.rollout.engine != "native":
            raise ValueError(
                "sampling.batch_invariant runs each sample's forward on its own in the native engine's "
                f"sampler; rollout.engine={self.rollout.engine} samples its own way: use the native engine"
            )

    def _validate_shared_base(self) -> None:
        """rollout.base_weights=trainer: the trainer shares, on the same GPU, in the same dtype."""
        if self.rollout.base_weights != "trainer":
            return
        trainer = self.trainer
        if not trainer.share_base or self.launch.trainer_nproc > 1:
            raise ValueError(
                "rollout.base_weights=trainer maps the base the trainer shares: set trainer.share_base=true "
                f"with one trainer process (launch.trainer_nproc={self.launch.trainer_nproc})"
            )
        if trainer.dtype != self.rollout.dtype:
            raise ValueError(
                f"rollout.base_weights=trainer maps the trainer's weights as they are: rollout.dtype="
                f"{self.rollout.dtype} must equal trainer.dtype={trainer.dtype}"
            )
        if self.rollout.checkpoint and trainer.checkpoint and self.rollout.checkpoint != trainer.checkpoint:
            raise ValueError(
                f"rollout.base_weights=trainer maps the trainer's weights of {trainer.checkpoint}, but "
                f"rollout.checkpoint={self.rollout.checkpoint}: give both the same checkpoint (or leave "
                "them empty: they follow model.checkpoint)"
            )
        devices = self.launch.rollout_devices or [self.rollout.device]
        other = [d for d in devices if _gpu_index(d) != _gpu_index(trainer.device)]
        if other:
            raise ValueError(
                f"rollout.base_weights=trainer maps memory of the trainer's GPU ({trainer.device}); rollout "
                f"devices {other} are other GPUs: put them on the trainer's GPU or load the checkpoint "
                "(rollout.base_weights=checkpoint)"
            )

    def _validate_algorithm(self) -> None:
        algorithm_of(self.trainer).check(self.trainer, self.sampling)


def _relative_to_recipe(cfg: RunConfig, folder: Path, overrides: Sequence[str]) -> RunConfig:
    for key in RECIPE_RELATIVE:
        if any(o.split("=", 1)[0].strip() == key for o in overrides):
            continue  # typed on the command line: relative to where it was typed
        section, field_name = key.split(".")
        part = getattr(cfg, section)
        value = getattr(part, field_name)
        if value and not Path(value).is_absolute():
            cfg = replace(cfg, **{section: replace(part, **{field_name: str(folder / value)})})
    return cfg


def _gpu_index(device: str) -> int:
    """The CUDA index of a device name; -1 for a CPU (never the trainer's GPU)."""
    kind, _, index = device.partition(":")
    return int(index or 0) if kind == "cuda" else -1


def _names_a_gen_linear(target: str) -> bool:
    """Whether a LoRA target (a module-name suffix, as peft matches them) names a gen-path linear."""
    return any(name == target or name.endswith("." + target) for name in GEN_PATH_LINEARS)


# Paths a recipe may give relative to itself (so `flowgrpo train /abs/path/recipe.yaml` works from
# any folder); the same keys given on the command line are relative to the working directory.
RECIPE_RELATIVE = ("data.prompts", "data.dataset", "model.checkpoint")


def load_run_config(recipe: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """A recipe plus ``section.key=value`` overrides, validated (``ConfigError`` names the key).
    The recipe's own relative paths (:data:`RECIPE_RELATIVE`) are resolved against its folder."""
    cfg = load_config(RunConfig, recipe, overrides)
    if recipe is not None:
        cfg = _relative_to_recipe(cfg, Path(recipe).resolve().parent, overrides)
    if not cfg.run_dir:
        cfg = replace(cfg, run_dir=str(Path("runs") / cfg.name))
    return cfg


def read_recipe_sections(recipe: str | Path, *, saved: bool = False) -> RunConfig:
    """A recipe without the run-level checks (``flowgrpo serve ROLE --recipe``: a service takes
    only its own section, validated as that service's config). ``saved``: a run folder's
    config.yaml, which an older version may have written (:func:`upgraded_run_config`)."""
    try:
        data = read_yaml_file(recipe) or {}
    except YamlError as error:
        raise ConfigError(str(error)) from None
    if saved and isinstance(data, Mapping):
        data = upgraded_run_config(data)
    try:
        cfg = from_dict(RunConfig, data)
    except ConfigError as error:
        raise ConfigError(f"{recipe}: {error}") from None
    return cfg if cfg.run_dir else replace(cfg, run_dir=str(Path("runs") / cfg.name))


def upgraded_run_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A run's saved config (its folder's config.yaml, plain data) in today's layout: a run made
    by an older version resumes, and its checkpoints load, without an edit by hand."""
    trainer = data.get("trainer")
    return {**data, "trainer": upgraded_trainer(trainer)} if isinstance(trainer, Mapping) else dict(data)


def with_checkpoint(cfg: RunConfig, checkpoint: str) -> RunConfig:
    """``cfg`` with ``checkpoint`` as the model, and as each service's checkpoint that follows it."""
    rollout = cfg.rollout if cfg.rollout.checkpoint else replace(cfg.rollout, checkpoint=checkpoint)
    trainer = cfg.trainer if cfg.trainer.checkpoint else replace(cfg.trainer, checkpoint=checkpoint)
    return replace(cfg, model=replace(cfg.model, checkpoint=checkpoint), rollout=rollout, trainer=trainer)

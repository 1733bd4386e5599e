"""Every setting of a run: one :class:`Config` of sections, each the settings object of the code
that uses it, each checking its own values when it is built.

- ``run`` (:class:`RunSettings`): the run folder, seeds, schedule, checkpoints, logs;
- ``model`` (:class:`ModelSettings`): the start model, device, precision, threads;
- ``lora`` (:class:`agents.policies.lora.LoraSettings`): the LoRA adapters (rank 0: none);
- ``rollout`` (:class:`agents.rollout.runner.RolloutSettings`): the task and how episodes are played;
- ``pretrain`` (:class:`learner.pretrain.PretrainSettings`): the start model's pretraining;
- ``rl`` (:class:`RLSettings`): the RL iteration: tasks, advantages, optimizer;
- ``loss`` (:class:`learner.loss.LossSettings`): the GRPO loss;
- ``replay`` (:class:`learner.state.ReplaySettings`): the replay buffer and the replay updates;
- ``eval`` (:class:`EvalSettings`): held-out evaluations and the delivered policy;
- ``scale`` (:class:`ScaleSettings`): rollout workers and asynchronous collection;
- ``engine`` (:class:`agents.rollout.engine.EngineSettings`): the sampling engine (hf or vLLM).

Each setting has one flat name, the command-line flag (``--tau``) and the key of ``--config``
files and of a run's saved ``config.yaml`` (``tau: 5``): the section's prefix (``pretrain_``,
``lora_``, ``eval_``) and the field's name, or the ``flag`` its field metadata names
(``ReplaySettings.capacity`` is ``--buffer-capacity``). A ``--config`` file may also nest
settings under their section, by field name (``replay: {tau: 5, capacity: 320}``). Field
metadata ``locked`` marks the settings a resume may not change; ``setting: False`` a field
that is not a setting of its own (:class:`Config` fills it from another section).
``--async`` is another spelling of ``--async-collect``; ``--is-weights base|classical`` sets
``--is-target`` and ``--is-normalize`` together (:data:`SHORTHANDS`).

Checks that span sections live in :meth:`Config.check_across`; what depends on the machine
(the device, the precision it supports) in :func:`check_machine`, run when a run starts, so a
saved config from another machine still loads.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from agents.policies.lora import LoraSettings
from agents.policies.spec import PolicySpec
from agents.rollout.engine import EngineSettings
from agents.rollout.runner import RolloutSettings
from agents.rollout.seeds import MAX_RUN_SEED
from learner.cli import add_flag, check_type, field_docs, load_config_file
from learner.loss import LossSettings
from learner.pretrain import PretrainSettings
from learner.state import ReplaySettings

#: RL iterations of the default run (``python train.py``): with two replay updates per iteration
#: the delivered policy meets 0.60 held-out success and a 0.75 safe-move probe on 5 of 5 seeds
#: on 2 CPU cores and 4 of 5 on a GPU after 200 (docs/results/frozenlake.md#two-hundred-iterations).
DEFAULT_ITERATIONS = 200

_LOCKED = {"locked": True}


@dataclass
class RunSettings:
    """The run folder, its seeds, how long it runs, its checkpoints and logs."""

    run_name: str | None = field(default=None, metadata=_LOCKED)
    """outputs go to runs_root/run_name; default: <task>__s<seed>__<date-time>"""
    runs_root: str = field(default="runs", metadata=_LOCKED)
    """folder holding the run folders"""
    seed: int = field(default=0, metadata=_LOCKED)
    """seed of everything (model init and pretraining unless --start-seed, tasks, sampling, replay)"""
    start_seed: int | None = field(default=None, metadata=_LOCKED)
    """seed of the start model alone (the embedded model's initialisation and its pretraining); default: --seed. Runs of several --seed values with one --start-seed share one start (built and cached once), so their spread is RL's alone, not the pretraining's"""
    iterations: int | None = None
    """stop after this many iterations; if neither this nor --time-budget is set: 200"""
    time_budget: float | None = None
    """stop the RL phase after this many seconds"""
    checkpoint_every: int = 25
    """write a checkpoint every this many iterations (and at the end)"""
    keep_checkpoints: int = 2
    """how many checkpoints to keep"""
    resume: str | None = None
    """continue from a checkpoint, a checkpoints/ folder or a run folder"""
    tensorboard: bool = True
    """write TensorBoard events to runs/<name>/tensorboard (--no-tensorboard: leave TensorBoard out of --report-to)"""
    report_to: str | None = None
    """experiment trackers that get the metrics and the replay figures, comma-separated: tensorboard, wandb (offline unless WANDB_API_KEY or WANDB_MODE=online), trackio (its local store), or none; default tensorboard (learner/trackers.py)"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        name = self.run_name
        checks = [
            (name is None or (name not in ("", ".", "..") and "/" not in name and "\\" not in name),
             f"--run-name must be a plain folder name inside --runs-root, got {name!r}"),
            (0 <= self.seed < MAX_RUN_SEED, f"--seed must be in [0, {MAX_RUN_SEED})"),
            (self.start_seed is None or 0 <= self.start_seed < MAX_RUN_SEED, f"--start-seed must be in [0, {MAX_RUN_SEED})"),
            (self.iterations is None or self.iterations >= 1, "--iterations must be >= 1"),
            (self.time_budget is None or (math.isfinite(self.time_budget) and self.time_budget > 0),
             "--time-budget must be > 0 seconds"),
            (self.checkpoint_every >= 0 and self.keep_checkpoints >= 1,
             "--checkpoint-every must be >= 0 and --keep-checkpoints >= 1"),
        ]
        _raise_first(checks)

    def planned_iterations(self) -> int | None:
        """The run's iteration count: ``--iterations``, else the default's unless a time budget alone ends it."""
        return self.iterations if (self.iterations is not None or self.time_budget is not None) else DEFAULT_ITERATIONS

    def model_seed(self) -> int:
        """The seed the start model is built and pretrained with (``--start-seed``, else ``--seed``)."""
        return self.seed if self.start_seed is None else self.start_seed


@dataclass
class ModelSettings:
    """The start model and where and how it computes."""

    model: str | None = field(default=None, metadata=_LOCKED)
    """local model folder (HF layout), a .gguf file or a known short name (python -m agents.pretrained list: converted on first use); default: the embedded tiny model of the task's modality, pretrained on the task"""
    tiny_width: int = field(default=128, metadata=_LOCKED)
    """hidden size of the embedded tiny model (a multiple of 64; without --model): 128, ~1M parameters; 256, ~3.7M, reads twice as many held-out SearchQA answers out of its passages when told the answer (experiments/searchqa/search_copy_ceiling.py) and is configs/searchqa.yaml's width; it costs more per step (docs/results/searchqa.md#a-model-twice-as-wide)"""
    device: str = "cpu"
    """torch device of the policy, its pretraining and its updates: cpu, cuda, cuda:N, or auto (CUDA where torch sees it)"""
    dtype: str = "auto"
    """compute precision of the policy, its KL reference, the sampler and vLLM: auto (bf16 on a GPU that supports it, else fp16; on the CPU, bf16 for a --model of 50M+ parameters where the CPU has bf16 units, AVX512-BF16 or AMX, fp32 otherwise: elsewhere bf16 is emulated, 3-6x slower than fp32), bf16, fp16 or fp32. Below fp32 the trained weights and Adam's state stay fp32 and forward passes run under autocast (mixed precision); log-probs are always fp32 (docs/scaling.md)"""
    gradient_checkpointing: bool = False
    """recompute each layer's activations in the backward pass: activation memory of one layer instead of all, for ~1/3 more compute; the learner then scores each sequence in one forward without the shared-prefix KV cache (docs/scaling.md)"""
    threads: int | None = None
    """torch intra-op threads for rollouts and evaluations (default: agents.policies.policy's, 1 on <= 2 CPUs)"""
    update_threads: int | None = None
    """torch intra-op threads for pretraining and the updates (default: available CPUs, at most 8)"""

    def __post_init__(self) -> None:
        from agents.policies.precision import CHOICES, DTYPES

        checks = [
            (str(self.dtype).lower() in CHOICES or str(self.dtype).lower() in DTYPES,
             f"--dtype must be one of {'|'.join(CHOICES)}, got {self.dtype!r}"),
            (self.tiny_width >= 64 and self.tiny_width % 64 == 0, "--tiny-width must be a multiple of 64"),
            (self.model is None or self.tiny_width == 128,
             "--tiny-width sizes the embedded model; --model brings its own (with a config that sets tiny_width, "
             "such as configs/searchqa.yaml, add --tiny-width 128)"),
        ]
        _raise_first(checks)


@dataclass
class RLSettings:
    """One RL iteration: which tasks, how advantages are taken, and the optimizer."""

    tasks_per_iter: int = field(default=8, metadata=_LOCKED)
    """B: tasks (maps) per iteration"""
    train_env_kwargs: dict | None = field(default=None, metadata=_LOCKED)
    """keyword arguments merged over --env-kwargs for the training tasks only, a curriculum (JSON; e.g. {"max_solution_moves": 4}: easier Sokoban levels); held-out evaluations, diagnostics and pretraining keep --env-kwargs, so success is still measured on the task"""
    advantage: str = field(default="episode", metadata=_LOCKED)
    """'episode': the GRPO advantage of the episode return on every turn; 'gigpo': plus a turn-level advantage (discounted return-to-go normalised among identical states of a group), window:k contexts only"""
    gigpo_gamma: float = field(default=0.95, metadata=_LOCKED)
    """discount of the turn-level return-to-go ('gigpo')"""
    step_weight: float = field(default=1.0, metadata=_LOCKED)
    """weight of the turn-level advantage added to the episode advantage ('gigpo')"""
    think_loss: bool = True
    """train the tokens of a reply's think tag like its other sampled tokens; --no-think-loss leaves <think> ... </think> out of the RL loss (the answer alone is trained)"""
    lr: float = 3e-4
    """Adam learning rate of the RL phase"""
    lr_warmup_steps: int = 0
    """linear learning-rate warm-up over this many optimizer steps"""
    lr_decay: str = field(default="none", metadata=_LOCKED)
    """none|linear|cosine: lower the RL learning rate towards 0 over the run's iterations (iteration i of N uses lr x (1 - i/N), or lr x (1 + cos(pi i/N)) / 2); needs an iteration count, not a time budget alone"""
    adam_beta1: float = 0.9
    """Adam's first-moment (momentum) decay of the RL phase; 0: no momentum, each step follows its own batch's gradient"""
    adam_beta2: float = 0.999
    """Adam's second-moment decay of the RL phase"""
    max_grad_norm: float = 1.0
    """gradient clipping by global norm (of the pretraining too)"""
    micro_batch: int = 256
    """sequences per forward/backward pass (gradients accumulate over the batch)"""
    micro_batch_tokens: int = 0
    """with --micro-batch, at most this many padded tokens (sequences x the longest) per forward/backward pass, a longer sequence alone; 0: no cap. A real model's multi-turn batches need one: a pass holds every layer's activations of its tokens (configs/real_*.yaml: 4096)"""

    def micro(self):
        """The micro-batch cut (:class:`learner.batch.MicroBatch`) of these settings."""
        from learner.batch import MicroBatch

        return MicroBatch(self.micro_batch, self.micro_batch_tokens)
    max_nonfinite: int = 5
    """stop the run after this many consecutive updates with a non-finite loss or gradient"""

    def __post_init__(self) -> None:
        checks = [
            (self.tasks_per_iter >= 1, "--tasks-per-iter must be >= 1"),
            (self.advantage in ("episode", "gigpo"), f"--advantage must be episode|gigpo, got {self.advantage!r}"),
            (self.lr_decay in ("none", "linear", "cosine"), f"--lr-decay must be none|linear|cosine, got {self.lr_decay!r}"),
            (math.isfinite(self.lr) and self.lr > 0, f"--lr must be a positive number, got {self.lr}"),
            (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0,
             f"--adam-beta1 and --adam-beta2 must be in [0, 1), got {self.adam_beta1} and {self.adam_beta2}"),
            (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0, "--max-grad-norm must be > 0"),
            (self.micro_batch >= 1 and self.max_nonfinite >= 1, "--micro-batch and --max-nonfinite must be >= 1"),
            (self.micro_batch_tokens >= 0, "--micro-batch-tokens must be >= 0 (0: no cap)"),
        ]
        _raise_first(checks)


def lr_factor(decay: str, it: int, iterations: int | None) -> float:
    """The ``--lr-decay`` multiplier of iteration ``it`` (0-based) of ``iterations``."""
    if decay == "none" or not iterations:
        return 1.0
    x = min(1.0, max(0.0, it / iterations))
    return 1.0 - x if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * x))


@dataclass
class EvalSettings:
    """Held-out evaluations and which policy the run delivers (flags ``--eval-*`` unless named)."""

    every: int = 10
    """evaluate on validation tasks every this many iterations (0: never during training): seeds disjoint from training and from the test tasks of the start-of-RL and final evaluations"""
    episodes: int = 64
    """episodes of a periodic (validation) evaluation"""
    select: str = field(default="best", metadata={"flag": "select"})
    """the policy the run delivers and scores on the test tasks beside the last iteration's: 'best' (the iteration with the highest validation success; the last one on ties and without periodic evaluations) or 'last'"""
    final_episodes: int = field(default=200, metadata={"flag": "final_eval_episodes"})
    """episodes of the start-of-RL and final evaluations: the learning claim compares these"""
    greedy: bool = False
    """greedy decoding in evaluations; default sampled at --temperature (the policy being trained)"""
    both: bool = True
    """also evaluate with the other decoding at the start of RL and at the end (reported beside the verdict)"""
    diagnostics: bool = field(default=True, metadata={"flag": "diagnostics"})
    """log what the policy looks at with each held-out evaluation (action spread across states, counterfactual probes)"""
    gifs: int = field(default=4, metadata={"flag": "gifs"})
    """GIFs of evaluation episodes to save for image tasks"""

    def __post_init__(self) -> None:
        checks = [
            (self.select in ("best", "last"), f"--select must be best|last, got {self.select!r}"),
            (self.every >= 0 and self.episodes >= 1 and self.final_episodes >= 1,
             "--eval-every must be >= 0 and the evaluation episodes >= 1"),
        ]
        _raise_first(checks)


@dataclass
class ScaleSettings:
    """Scale-out: rollout workers and asynchronous collection (docs/scaling.md)."""

    rollout_workers: int = 0
    """Ray rollout workers that play each iteration's episodes (0: this process); $RAY_ADDRESS joins a running cluster, else a local one starts"""
    rollout_shards: int | None = None
    """collect each iteration in this many shards of whole task groups, each with its own sampling seed, so records depend on the shards and not on which process plays them; default: one per worker (1 in process)"""
    async_collect: bool = False
    """asynchronous collection (also --async): workers collect the next iterations with the last published weights while the learner updates; records keep their policy version, updates are IS-corrected"""
    max_staleness: int | None = None
    """asynchronous collection: records more than this many optimizer steps behind the learner are dropped and re-collected (counted and logged); workers collect max_staleness // (steps per iteration) iterations ahead; default: one iteration's steps"""
    max_restarts: int = 3
    """rollout-worker deaths survived within one collect (a dead worker is replaced and its episodes re-collected)"""
    worker_gpus: float = 0.0
    """GPUs each Ray rollout worker reserves (its vLLM engine runs on them); 0: CPU workers"""

    def __post_init__(self) -> None:
        checks = [
            (self.rollout_workers >= 0 and (self.rollout_shards is None or self.rollout_shards >= 1)
             and self.max_restarts >= 0 and self.worker_gpus >= 0,
             "--rollout-workers, --max-restarts and --worker-gpus must be >= 0, --rollout-shards >= 1"),
            (not self.async_collect or self.rollout_workers >= 1, "--async needs rollout workers (--rollout-workers N)"),
        ]
        _raise_first(checks)


def _raise_first(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _section(summary: str, prefix: str = "") -> dict[str, str]:
    """A section's metadata: what it holds (its --help heading) and its settings' name prefix."""
    return {"summary": summary, "prefix": prefix}


@dataclass
class Config:
    """Every setting of a run, by section (the module docstring lists them). Build one from
    flat settings with :func:`make_config` or :func:`config_from_dict`, from a command line
    with :func:`parse_config`; :func:`settings` gives the flat settings back."""

    run: RunSettings = field(default_factory=RunSettings,
                             metadata=_section("the run folder, its seeds, how long it runs, its checkpoints and logs"))
    model: ModelSettings = field(default_factory=ModelSettings,
                                 metadata=_section("the start model, its device, precision and threads"))
    lora: LoraSettings = field(default_factory=LoraSettings,
                               metadata=_section("LoRA adapters (rank 0: every weight trains)", "lora_"))
    rollout: RolloutSettings = field(default_factory=lambda: RolloutSettings(
        "freshper/FrozenLake-v0", None, "window:0", group_size=8, max_new_tokens=8, temperature=1.0,
        max_context_tokens=1024), metadata=_section("the task and how its episodes are played"))
    pretrain: PretrainSettings = field(default_factory=lambda: PretrainSettings(steps=None, until_exact=None),
                                     metadata=_section("the start model's pretraining on the task's own transitions",
                                                       "pretrain_"))
    rl: RLSettings = field(default_factory=RLSettings,
                           metadata=_section("one RL iteration: its tasks, the advantages, the optimizer"))
    loss: LossSettings = field(default_factory=lambda: LossSettings(kl_coef=0.04),
                             metadata=_section("the IS-corrected GRPO loss"))
    replay: ReplaySettings = field(default_factory=lambda: ReplaySettings(mode="fresh"),
                                   metadata=_section("the replay buffer and the replay updates"))
    eval: EvalSettings = field(default_factory=EvalSettings,
                               metadata=_section("held-out evaluations and the policy the run delivers", "eval_"))
    scale: ScaleSettings = field(default_factory=ScaleSettings,
                                 metadata=_section("rollout workers and asynchronous collection (docs/scaling.md)"))
    engine: EngineSettings = field(default_factory=EngineSettings,
                                  metadata=_section("the sampling engine of training rollouts (docs/scaling.md)"))

    def __post_init__(self) -> None:
        # the fields that are not settings of their own: the pretraining clips gradients as
        # the updates do, the buffer samples with the run's seed
        if self.pretrain.max_grad_norm != self.rl.max_grad_norm:
            self.pretrain = dataclasses.replace(self.pretrain, max_grad_norm=self.rl.max_grad_norm)
        if self.replay.seed != self.run.seed:
            self.replay = dataclasses.replace(self.replay, seed=self.run.seed)
        self.check_across()

    def check_across(self) -> None:
        """The checks that span sections (each section checks its own values when built)."""
        pre = self.pretrain
        checks = [
            (self.rl.lr_decay == "none" or self.run.iterations is not None or self.run.time_budget is None,
             "--lr-decay follows the iterations: give --iterations with --time-budget"),
            (self.rl.advantage != "gigpo" or self.rollout.context != "full",
             "--advantage gigpo needs a window:k context (one sample per turn)"),
            (self.rollout.group_size >= 2,
             "--group-size must be >= 2: GRPO's advantage compares the rollouts of a task, one alone always gets 0"),
            (not self.lora.rank or self.model.model is None or not (pre.steps or pre.follow_steps),
             "--lora-rank trains adapters over a fixed base: pretrain --model in a run of its own (without "
             "--lora-rank), then train LoRA from its checkpoint's model folder"),
            (self.scale.max_staleness is None or self.scale.max_staleness >= self.steps_per_iteration(),
             f"--max-staleness must be >= the optimizer steps of one iteration ({self.steps_per_iteration()}: "
             "1 + the replay updates), else every asynchronous batch would be dropped"),
        ]
        _raise_first(checks)

    def steps_per_iteration(self) -> int:
        """Optimizer steps one iteration makes: the on-policy update and the replay updates."""
        return 1 + self.replay.updates()

    def pretrains_embedded_model(self) -> bool:
        """Whether the start is the embedded model pretrained (and cached) before the run."""
        return self.model.model is None and (self.pretrain.steps is None or self.pretrain.steps > 0)

    def pretrains_given_model(self) -> bool:
        """Whether a ``--model`` is pretrained at the start of RL (``--pretrain-steps`` or
        ``--pretrain-follow-steps`` given with it)."""
        return self.model.model is not None and bool(self.pretrain.steps or self.pretrain.follow_steps)


# -- the flat settings: flags, config files, a run's config.yaml --------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting: its flat name, the section that holds it and the field."""

    name: str
    section: str
    field: dataclasses.Field

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def locked(self) -> bool:
        return bool(self.field.metadata.get("locked"))

    @property
    def kind(self) -> str:
        return str(self.field.type)

    def read(self, cfg: Config) -> Any:
        return getattr(getattr(cfg, self.section), self.field.name)


#: Other command-line spellings of a setting.
FLAG_ALIASES = {"async": "async_collect"}
#: Shorthands that set several settings at once: ``--is-weights base|classical`` (the one setting
#: of runs saved before ``--is-target`` and ``--is-normalize``).
SHORTHANDS: dict[str, dict[str, dict[str, Any]]] = {
    "is_weights": {"base": {"is_target": "base", "is_normalize": "batch"},
                   "classical": {"is_target": "uniform", "is_normalize": "buffer"}},
}


@functools.lru_cache(maxsize=None)
def section_classes() -> dict[str, type]:
    """The settings class of each section, in order."""
    default = Config()
    return {f.name: type(getattr(default, f.name)) for f in dataclasses.fields(Config)}


@functools.lru_cache(maxsize=None)
def all_settings() -> dict[str, Setting]:
    """Every setting by its flat name, section by section."""
    out: dict[str, Setting] = {}
    for section in dataclasses.fields(Config):
        prefix = section.metadata.get("prefix", "")
        for f in dataclasses.fields(section_classes()[section.name]):
            if f.metadata.get("setting", True) is False:
                continue
            name = f.metadata.get("flag") or prefix + f.name
            if name in out:
                raise RuntimeError(f"two settings are called {name}: {out[name].section} and {section.name}")
            out[name] = Setting(name, section.name, f)
    return out


def locked_on_resume() -> tuple[str, ...]:
    """The settings that shape what a run has already done; a resume refuses to change them."""
    return tuple(name for name, s in all_settings().items() if s.locked)


def settings(cfg: Config) -> dict[str, Any]:
    """The flat settings of ``cfg`` (what a run's ``config.yaml`` holds)."""
    return {name: s.read(cfg) for name, s in all_settings().items()}


def flatten(values: dict[str, Any]) -> dict[str, Any]:
    """Settings given by flat name or nested under their section (``{"replay": {"tau": 5}}``),
    as flat names with values checked against their types; unknown names are an error that
    names the nearest valid one."""
    known = all_settings()
    sections = section_classes()
    out: dict[str, Any] = {}
    unknown: list[tuple[str, list[str]]] = []
    for key, value in values.items():
        if key in sections and isinstance(value, dict) and key not in ("env_kwargs",):
            by_field = {s.field.name: n for n, s in known.items() if s.section == key}
            for sub, inner in value.items():
                name = by_field.get(sub) or (sub if sub in known and known[sub].section == key else None)
                if name is None:
                    unknown.append((f"{key}.{sub}", [f"{key}.{f}" for f in by_field]))
                else:
                    out[name] = check_type(name, known[name].kind, inner)
            continue
        if key in SHORTHANDS:
            if value not in SHORTHANDS[key]:
                raise ValueError(f"--{key.replace('_', '-')} must be {'|'.join(SHORTHANDS[key])}, got {value!r}")
            out.update(SHORTHANDS[key][value])
            continue
        name = FLAG_ALIASES.get(key, key)
        if name not in known:
            unknown.append((key, [*known, *SHORTHANDS, *FLAG_ALIASES]))
            continue
        out[name] = check_type(name, known[name].kind, value)
    if unknown:
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, pool, 1)) else k
                 for k, pool in unknown]
        raise ValueError(f"unknown config keys: {', '.join(hints)}")
    return out


def config_from_dict(values: dict[str, Any], base: Config | None = None) -> Config:
    """A Config with ``values`` (flat or nested settings, :func:`flatten`) applied over ``base``
    (default: the defaults); each changed section is built once, checking itself."""
    flat = flatten(values)
    base = base or Config()
    known = all_settings()
    changes: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        s = known[name]
        changes.setdefault(s.section, {})[s.field.name] = value
    sections = {f.name: getattr(base, f.name) for f in dataclasses.fields(Config)}
    for section, fields in changes.items():
        sections[section] = dataclasses.replace(sections[section], **fields)
    return Config(**sections)


def make_config(**values: Any) -> Config:
    """``make_config(tau=5, replay_ratio=1)``: a Config from flat settings, as the flags name them."""
    return config_from_dict(values)


def with_settings(cfg: Config, **values: Any) -> Config:
    """A copy of ``cfg`` with flat settings changed: ``with_settings(cfg, tau=5)``."""
    return config_from_dict(values, cfg)


def to_yaml(cfg: Config) -> str:
    """A run's ``config.yaml``: its flat settings."""
    import yaml

    return yaml.safe_dump(settings(cfg), sort_keys=False)


# -- the command line ----------------------------------------------------------------------------
def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """``--config`` plus one documented flag per setting (and ``--async`` for ``--async-collect``)."""
    from envs.cli import ArgumentParser, add_import_flag

    parser = ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML file of settings, flat (tau: 5) or by section (replay: {tau: 5}); "
                                         "flags given here override it")
    add_import_flag(parser)
    default = Config()
    groups = {}
    for section in dataclasses.fields(Config):
        cls = section_classes()[section.name]
        groups[section.name] = (parser.add_argument_group(f"{section.name} settings", section.metadata["summary"]),
                                field_docs(cls))
    for name, s in all_settings().items():
        group, docs = groups[s.section]
        add_flag(group, name, s.kind, s.read(default), docs.get(s.field.name, ""))
    parser.add_argument("--async", dest="async_collect", action="store_true", default=argparse.SUPPRESS,
                        help="same as --async-collect")
    parser.add_argument("--is-weights", choices=list(SHORTHANDS["is_weights"]), default=argparse.SUPPRESS,
                        help="PER importance weights: 'base' (--is-target base --is-normalize batch: correct the "
                             "base-priority bias, keep the age decay) or 'classical' (--is-target uniform "
                             "--is-normalize buffer: (N P(i))^-beta normalised over the buffer, as Schaul et al.)")
    return parser


def parse_config(argv: Sequence[str] | None = None, description: str | None = None) -> Config:
    """Defaults <- ``--config`` YAML <- flags. On ``--resume`` the run's saved config is the base
    and the flags and YAML may change only what may change mid-run (others are refused)."""
    from learner.checkpoint import CheckpointError, resolve_resume

    from envs.cli import import_tasks

    args = vars(build_parser(description).parse_args(argv))
    import_tasks(args.pop("imports"))  # --import: a module or file whose tasks the run names by id
    given: dict[str, Any] = {}
    path = args.pop("config", None)
    if path:
        given.update(flatten(load_config_file(path)))
    given.update(flatten(args))
    if not given.get("resume"):
        cfg = config_from_dict(given)
    else:
        ckpt = resolve_resume(given["resume"])
        saved_path = ckpt / "config.yaml"
        if not saved_path.exists():
            raise CheckpointError(f"{ckpt} has no config.yaml: it is not a train.py checkpoint")
        saved = config_from_dict(load_config_file(saved_path, follow_links=False))
        was = settings(saved)
        locked = locked_on_resume()
        changed = [k for k in locked if k in given and given[k] != was[k]]
        if changed:
            flags = ", ".join(f"--{k.replace('_', '-')} ({was[k]!r} -> {given[k]!r})" for k in changed)
            raise ValueError(f"cannot change {flags} when resuming {ckpt}: the run was trained with the saved "
                             "values; start a new run (--run-name) to train with other ones")
        cfg = config_from_dict({k: v for k, v in given.items() if k not in locked}, saved)
        before, after = saved.run.planned_iterations(), cfg.run.planned_iterations()
        if saved.rl.lr_decay != "none" and after != before:
            raise ValueError(f"cannot change the iterations ({before} -> {after}) "
                             f"when resuming {ckpt}: its --lr-decay {saved.rl.lr_decay} runs over them; resume with the "
                             "same --iterations, or start a new run")
    check_machine(cfg)
    return cfg


def policy_spec(cfg: Config) -> PolicySpec:
    """The policy a run trains, as passed to whatever loads, plays or serves it: ``--dtype``
    resolved on ``--device`` (``auto`` decided here, the one place a run resolves it) and the
    ``--lora-*`` adapters. A ValueError where this machine cannot run it."""
    from agents.policies.policy import resolve_device

    parameters = None
    if str(cfg.model.dtype).lower() == "auto" and cfg.model.model is not None:
        from agents.pretrained import model_parameters

        parameters = model_parameters(cfg.model.model)
    return PolicySpec.resolve(cfg.model.dtype, resolve_device(cfg.model.device), cfg.lora, parameters)


def precision_warning(cfg: Config) -> str | None:
    """A warning where the run's precision is bf16 on a CPU that emulates it (then several times
    slower than fp32), else None."""
    from agents.policies.policy import resolve_device
    from agents.policies.precision import EMULATED_BF16, emulated_bf16

    try:
        spec = policy_spec(cfg)
    except ValueError:
        return None  # the run refuses it with its own error
    return EMULATED_BF16 if emulated_bf16(spec.compute_dtype, resolve_device(cfg.model.device)) else None


def check_machine(cfg: Config) -> None:
    """Raise ValueError where this machine cannot run ``cfg``: its device, or its precision there."""
    policy_spec(cfg)


@dataclass(frozen=True)
class Resolved:
    """A run's settings with what its start decides, resolved once before anything is built
    (:func:`resolve`); nothing changes them afterwards."""

    cfg: Config
    """the settings, the task's default keyword arguments and the run name filled in (what the run's config.yaml says)"""
    spec: PolicySpec
    """the compute dtype (``--dtype`` on the device) and the LoRA adapters: what the learner, the sampler, the engine and the workers are handed"""
    update_threads: int
    """torch threads of pretraining and the updates (``--update-threads``, else the available CPUs per rank, at most 8)"""
    world: int = 1
    """processes of a sharded learner (1: one process)"""

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def train_env_kwargs(self) -> dict[str, Any]:
        """The training tasks' keyword arguments: ``--env-kwargs`` with ``--train-env-kwargs`` over them."""
        return {**self.cfg.rollout.env_kwargs, **(self.cfg.rl.train_env_kwargs or {})}


def resolve(cfg: Config, *, world: int = 1, now: str | None = None) -> Resolved:
    """Check ``cfg`` (:func:`validate`) and resolve what the start decides: the task's default
    keyword arguments, the run name of a new run (``<task>__s<seed>__<date-time>``), the policy
    spec and the update threads. ``cfg`` itself is left as it is."""
    import time

    from learner.machine import available_cpus

    validate(cfg)
    changes: dict[str, Any] = {}
    if cfg.rollout.env_kwargs is None:
        changes["rollout"] = dataclasses.replace(cfg.rollout, env_kwargs=cfg.rollout.task_kwargs())
    if not cfg.run.resume and not cfg.run.run_name:
        stamp = now or time.strftime("%Y%m%d-%H%M%S")
        name = f"{cfg.rollout.env_id.split('/')[-1]}__s{cfg.run.seed}__{stamp}"
        changes["run"] = dataclasses.replace(cfg.run, run_name=name)
    resolved = dataclasses.replace(cfg, **changes) if changes else copy.deepcopy(cfg)
    threads = cfg.model.update_threads or max(1, min(8, available_cpus() // max(1, world)))
    return Resolved(resolved, policy_spec(resolved), threads, max(1, world))


def validate(cfg: Config) -> None:
    """Raise ValueError on settings that cannot work, saying which flag to change: the checks
    across sections (each section checked its own values when it was built) and the machine's."""
    cfg.check_across()
    check_machine(cfg)

"""The head-count sweep (seed 003's claim): same width, same parameters, h from 1 to d_model.

Shape legend: B batch, T sequence length, d_model model width, h heads, d_k = d_model / h,
C output classes.

For every task, every h dividing d_model and every seed, one small transformer
(:mod:`mha.experiments.model`) is trained from scratch on freshly generated batches
(:mod:`mha.experiments.tasks`) and evaluated on a fixed held-out set. A seed fixes the model's
initialisation and the training data stream, so the runs of one seed differ only in h.
:func:`run_sweep` returns the results as a plain dict (what ``results.json`` holds).
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from mha.experiments.model import ModelConfig, TinyTransformer, served_by
from mha.experiments.tasks import IGNORE, make_task
from mha.threads import num_threads

EVAL_SEED = 987_654  # the held-out set is the same for every run
#: The most work one sweep may take, in layer-steps (tasks x head counts x seeds x steps x
#: layers): about 26 times the full preset's 75,600 (3 tasks x 7 head counts x 3 seeds x 600
#: steps x 2 layers); more is a typo (--seeds 1000000000, --layers 100000), not a plan.
MAX_LAYER_STEPS = 2_000_000


class ConfigError(ValueError):
    """A :class:`HeadsConfig` refused by :meth:`HeadsConfig.validate`: ``field`` names the
    setting at fault (``"layer_steps"`` when the sweep as a whole is too large) and the message
    is ``f"{subject} {rest}"`` (``subject`` the field unless given), so a caller can name the
    setting in its own spelling (an option) before ``rest``."""

    def __init__(self, field: str, rest: str, subject: str | None = None):
        super().__init__(f"{subject or field} {rest}")
        self.field, self.rest = field, rest


@dataclass(frozen=True)
class HeadsConfig:
    """One sweep. ``heads=None`` means every divisor of ``d_model``."""

    preset: str = "full"
    d_model: int = 64
    n_layers: int = 2
    heads: tuple[int, ...] | None = None
    tasks: tuple[str, ...] = ("lags", "recall", "markov")
    seeds: int = 3
    steps: int = 600
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 60
    weight_decay: float = 0.01
    eval_size: int = 512
    eval_points: int = 6  # held-out evaluations along training (for the learning curves)
    threads: int = 1  # torch threads: these models are small and the machine is shared

    def head_counts(self) -> tuple[int, ...]:
        if self.heads is not None:
            return tuple(self.heads)
        return tuple(h for h in range(1, self.d_model + 1) if self.d_model % h == 0)

    def layer_steps(self) -> int:
        """The sweep's work: training steps of every task, head count and seed, times the
        layers each step runs through."""
        return (len(self.tasks) * len(self.head_counts()) * self.seeds * self.steps
                * self.n_layers)

    def size_text(self) -> str:
        """How :meth:`layer_steps` is made up, e.g. ``2 tasks x 2 head counts x 1 seeds x 60
        steps x 2 layers``."""
        return (f"{len(self.tasks)} tasks x {len(self.head_counts())} head counts x "
                f"{self.seeds} seeds x {self.steps} steps x {self.n_layers} layers")

    def validate(self) -> HeadsConfig:
        """Raises :class:`ConfigError` naming the field at fault; returns ``self``."""
        bad = [h for h in self.head_counts() if h <= 0 or self.d_model % h]
        if bad:
            raise ConfigError("heads", f"must divide d_model={self.d_model} (d_k = d_model / h), "
                                       f"got {bad}")
        repeated = sorted({h for h in self.head_counts() if self.head_counts().count(h) > 1})
        if repeated:
            raise ConfigError("heads", f"lists {', '.join(map(str, repeated))} more than once")
        for name in ("d_model", "n_layers", "seeds", "steps", "batch", "eval_size", "threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        for t in self.tasks:
            try:
                make_task(t)
            except ValueError as e:
                raise ConfigError("tasks", f"names an unknown task: {e}") from None
        if self.layer_steps() > MAX_LAYER_STEPS:
            raise ConfigError("layer_steps", f"would train {self.layer_steps():,} layer-steps "
                              f"({self.size_text()}), at most {MAX_LAYER_STEPS:,}: lower seeds, "
                              "steps, n_layers, heads or tasks", subject="the sweep")
        return self


PRESETS = {
    # test-suite size: two head counts, a few steps, one seed (seconds)
    "tiny": HeadsConfig(preset="tiny", d_model=16, heads=(1, 4), tasks=("lags", "markov"),
                        seeds=1, steps=60, batch=32, warmup=10, eval_size=256, eval_points=3),
    # every divisor of 64, one seed, short training (`mha experiment heads --quick`: ~2.3 CPU-min
    # on epyc-zen5-avx512, docs/experiments.md)
    "quick": HeadsConfig(preset="quick", seeds=1, steps=300, warmup=30, eval_points=3),
    # the real run, sized for a shared 2-core machine: `mha experiment heads --out DIR` took
    # 44 min of wall time and 15 min of CPU time on epyc-zen5-avx512, 1 thread
    # (docs/experiments/results.json: environment.wall_time_s, the runs' cpu_s summed)
    "full": HeadsConfig(),
}


def preset(name: str, **overrides) -> HeadsConfig:
    """A preset with some fields replaced (``None`` values are ignored)."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def lr_at(step: int, cfg: HeadsConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def loss_and_acc(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """Over the scored positions (``y != IGNORE``): the cross-entropy (mean over positions and
    slots), the accuracy (a position is right when all its S slots are) and the accuracy of
    each slot ``(S,)``. logits ``(B, T, S, C)``, y ``(B, T, S)``."""
    B, T, S, C = logits.shape
    keep = (y != IGNORE).all(dim=-1)  # (B, T)
    flat, target = logits[keep], y[keep]  # (N, S, C), (N, S)
    loss = F.cross_entropy(flat.reshape(-1, C), target.reshape(-1))  # (N*S, C) vs (N*S,)
    right = flat.argmax(dim=-1) == target  # (N, S)
    return loss, right.all(dim=-1).float().mean(), right.float().mean(dim=0)


@torch.no_grad()
def evaluate(model: TinyTransformer, data: tuple[torch.Tensor, torch.Tensor]):
    """Held-out ``(loss, accuracy, per-slot accuracies)``."""
    model.eval()
    loss, acc, slots = loss_and_acc(model(data[0]), data[1])
    model.train()
    return float(loss), float(acc), [round(float(a), 4) for a in slots]


def train_one(task, num_heads: int, seed: int, cfg: HeadsConfig, eval_data,
              on_step=None) -> dict:
    """Train one model; return its record (see ``results.json``)."""
    torch.manual_seed(seed)
    mcfg = ModelConfig(d_model=cfg.d_model, num_heads=num_heads, n_layers=cfg.n_layers,
                       n_inputs=task.n_inputs, n_classes=task.n_classes, max_len=task.seq_len,
                       n_slots=task.n_slots)
    model = TinyTransformer(mcfg)
    params = model.param_counts()
    backend = served_by(model, cfg.batch, task.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    init_loss, init_acc, _ = evaluate(model, eval_data)
    marks = {round(cfg.steps * (i + 1) / cfg.eval_points) for i in range(cfg.eval_points)}
    eval_curve = [[0, init_loss, init_acc]]
    train_curve = []
    every = max(1, cfg.steps // 50)
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = task.batch(cfg.batch, gen)  # (B, T), (B, T, S)
        loss, _, _ = loss_and_acc(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # through mha.MultiHeadAttention's backward
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % every == 0:
            train_curve.append([step, loss.item()])
        if step + 1 in marks:
            ev_loss, ev_acc, slot_acc = evaluate(model, eval_data)
            eval_curve.append([step + 1, ev_loss, ev_acc])
        if on_step is not None:
            on_step()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    final_loss, final_acc = eval_curve[-1][1], eval_curve[-1][2]
    return {
        "task": task.name, "num_heads": num_heads, "head_dim": cfg.d_model // num_heads,
        "d_model": cfg.d_model, "n_layers": cfg.n_layers, "seed": seed, "steps": cfg.steps,
        "batch": cfg.batch, "time_s": round(elapsed, 3),
        "cpu_s": round(cpu, 3), "params": params, "backend": backend,
        "metrics": {"init_loss": init_loss, "init_acc": init_acc, "final_loss": final_loss,
                    "final_acc": final_acc, "final_slot_acc": slot_acc, "eval_curve": eval_curve,
                    "train_curve": train_curve},
    }


def task_info(task) -> dict:
    info = {"claim": task.claim, "seq_len": task.seq_len, "n_inputs": task.n_inputs,
            "n_classes": task.n_classes, "n_slots": task.n_slots, "chance_loss": task.chance_loss(),
            "settings": {k: v for k, v in asdict(task).items() if not k.startswith("_")}}
    if hasattr(task, "entropy"):
        info["best_possible_loss"] = task.entropy()
    return info


def run_sweep(cfg: HeadsConfig, *, progress=None, log=None) -> dict:
    """Every (seed, task, h) run of ``cfg``, seeds outermost (a stopped sweep still holds whole
    seeds). ``progress`` is an optional rich Progress (bars are added to it); ``log(record,
    results)`` is called after each run with the results so far (e.g. to save them). The runs use
    ``cfg.threads`` torch threads; the caller's thread count is restored afterwards."""
    cfg.validate()
    with num_threads(cfg.threads):
        return _sweep(cfg, progress, log)


def _sweep(cfg: HeadsConfig, progress, log) -> dict:
    tasks = [make_task(name) for name in cfg.tasks]
    heads = cfg.head_counts()
    eval_sets = {t.name: t.batch(cfg.eval_size, torch.Generator().manual_seed(EVAL_SEED))
                 for t in tasks}
    total = len(tasks) * len(heads) * cfg.seeds
    overall = progress.add_task("all runs", total=total) if progress else None
    results = {
        "config": asdict(cfg) | {"heads": list(heads)},
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(),
                        "python": platform.python_version(), "machine": platform.machine(),
                        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                        "mha_revision": _revision(), "wall_time_s": None, "complete": False},
        "tasks": {t.name: task_info(t) for t in tasks},
        "runs": [],
    }
    t_start = time.perf_counter()
    for seed in range(cfg.seeds):
        for task in tasks:
            for h in heads:
                bar = None
                if progress:
                    bar = progress.add_task(f"{task.name} h={h} seed={seed}", total=cfg.steps)
                step_cb = (lambda b=bar: progress.advance(b)) if progress else None
                rec = train_one(task, h, seed, cfg, eval_sets[task.name], on_step=step_cb)
                results["runs"].append(rec)
                results["environment"]["wall_time_s"] = round(time.perf_counter() - t_start, 1)
                if progress:
                    progress.remove_task(bar)
                    progress.advance(overall)
                if log:
                    log(rec, results)
    results["environment"]["complete"] = True
    return results


def _revision() -> str | None:
    """The git commit of the mha sources, with ``+dirty`` when they differ from it (None
    outside a git checkout): the native kernels are built from the working tree."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", ".."], cwd=here,
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")

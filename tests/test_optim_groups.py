"""Parameter groups, learning-rate schedules and `from_torch`, against torch.optim bit for bit.

- groups (a weight-decay mask, a smaller lr on a backbone, a frozen backbone at lr 0, other betas
  and eps, all of them at once), with and without a warmup-cosine schedule: `fs.optim.adamw`
  equals `torch.optim.AdamW` with the equivalent param groups and `lr_scheduler`, 100 steps, on
  whole tensors and on flat tensors whose cuts run through leaves of different groups;
- every schedule: the very floats of its `torch.optim.lr_scheduler` equivalent, in any order of
  counts, and AdamW under it equal to torch's over 100 steps (float64, where the last bit of
  the learning rate shows);
- SGD with groups (momentum 0 in one group, Nesterov in another) equal to `torch.optim.SGD`;
- `fs.optim.from_torch` of a torch AdamW / SGD with param groups and a scheduler: same bits;
- in `fs.sharded_step`: one rank against a torch module, AdamW + groups + schedule, 100 steps
  (traced, and eager), bit for bit; two gloo ranks whose shards are cut through leaves of
  different groups: each step's update equals the per-leaf update of the same gradient, traced
  == eager, donated too;
- errors: a rule that matches no leaf, a group shadowed by earlier ones, an option the
  optimizer has no group value for, a torch optimizer or scheduler passed to `fs.sharded_step`.
"""

from __future__ import annotations

import fnmatch
import math
import random
import re
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler as L

import functional_shard as fs
from functional_shard import optim
from functional_shard.models import MLP

STEPS = 100

# A small "model" as named tensors: a backbone, a head, biases, a norm and a 0-d leaf.
SHAPES = {
    "embed.weight": (11, 6),
    "backbone.0.weight": (6, 6),
    "backbone.0.bias": (6,),
    "backbone.norm.weight": (6,),
    "backbone.1.weight": (7, 6),
    "backbone.1.bias": (7,),
    "head.weight": (3, 7),
    "head.bias": (3,),
    "scale": (),
}
BASE = dict(lr=1e-2, weight_decay=0.1)

# name -> (rules and options of each group, in order); the same groups for fs and for torch.
CASES = {
    "decay_mask": [(("*.bias", "*norm*"), {"weight_decay": 0.0})],
    "backbone_lr": [(("backbone.*",), {"lr": 1e-4})],
    "frozen_backbone": [(("backbone.*",), {"lr": 0.0})],
    "betas_eps": [(("head.*",), {"betas": (0.8, 0.99), "eps": 1e-6})],
    "all": [
        (("*.bias", "*norm*"), {"weight_decay": 0.0}),
        (("backbone.*",), {"lr": 3e-3, "weight_decay": 0.3}),
        (("head.*",), {"betas": (0.8, 0.99), "eps": 1e-6}),
    ],
}


def assign(paths, groups) -> dict[str, int]:
    """The test's own reading of the rules: first matching group wins, 0 for none."""
    return {p: next((i + 1 for i, (rules, _) in enumerate(groups) if any(fnmatch.fnmatchcase(p, r) for r in rules)), 0) for p in paths}


def torch_groups(params: dict, groups, defaults: dict) -> list[dict]:
    owner = assign(list(params), groups)
    out = []
    for g, options in enumerate([defaults] + [o for _, o in groups]):
        members = [p for n, p in params.items() if owner[n] == g]
        if members:
            out.append({"params": members, **options})
    return out


def init_tensors(dtype=torch.float32, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}


def grads_at(step: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for n, s in SHAPES.items()}


# The flat layout: the leaves back to back, cut into two tensors at element 80 (inside
# backbone.0.weight), the second padded by 3 elements, as a step's shards are.
CUT, PAD = 80, 3


def flat_layout() -> tuple[optim.LeafLayout, list[int]]:
    sizes = [math.prod(s) for s in SHAPES.values()]
    total = sum(sizes)
    bounds = [(0, CUT), (CUT, total)]
    ranges, offset = {"a": [], "b": []}, 0
    for path, size in zip(SHAPES, sizes):
        for key, (lo, hi) in zip(ranges, bounds):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                ranges[key].append(optim.LeafRange(path, a - lo, b - lo))
        offset += size
    layout = optim.LeafLayout(tuple(SHAPES), tuple(SHAPES.values()), {k: tuple(v) for k, v in ranges.items()})
    return layout, [CUT, total - CUT + PAD]


def to_flat(tree: dict) -> dict[str, torch.Tensor]:
    flat = torch.cat([tree[n].reshape(-1) for n in SHAPES])
    return {"a": flat[:CUT].clone(), "b": torch.cat([flat[CUT:], flat.new_zeros(PAD)])}


def from_flat(flat: dict) -> dict[str, torch.Tensor]:
    whole = torch.cat([flat["a"], flat["b"][:-PAD]])
    out, offset = {}, 0
    for n, s in SHAPES.items():
        size = math.prod(s)
        out[n] = whole[offset : offset + size].view(s)
        offset += size
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def same_bits(a: dict, b: dict) -> list[str]:
    return [n for n in a if not torch.equal(bits(a[n]), bits(b[n]))]


def fs_groups(groups, lr_of=lambda lr: lr):
    out = []
    for rules, options in groups:
        options = dict(options)
        if "lr" in options:
            options["lr"] = lr_of(options["lr"])
        out.append(optim.group(*rules, **options))
    return out


def run_against_torch(make_fs, make_torch, make_scheduler, layout: str, dtype=torch.float32, steps=STEPS):
    """Steps the fs optimizer (on whole tensors, or on flat tensors with a LeafLayout) and torch's
    side by side with the same gradients; returns the names that differ after any step."""
    init = init_tensors(dtype)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    torch_opt = make_torch(params)
    scheduler = make_scheduler(torch_opt) if make_scheduler else None
    opt = make_fs()
    leaves, _ = flat_layout()
    mine = to_flat(init) if layout == "flat" else {n: t.clone() for n, t in init.items()}
    kwargs = {"leaves": leaves} if layout == "flat" else {}
    state = opt.init(mine, **kwargs)
    differ: set[str] = set()
    for i in range(steps):
        grads = grads_at(i, dtype)
        for n, p in params.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        if scheduler is not None:
            scheduler.step()
        g = to_flat(grads) if layout == "flat" else grads
        mine, state = opt.update(g, state, mine, **kwargs)
        got = from_flat(mine) if layout == "flat" else mine
        differ.update(same_bits(got, {n: p for n, p in params.items()}))
    # The state too: exp_avg / exp_avg_sq (or momentum buffers) leaf by leaf.
    for key in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
        tree = getattr(state, key, None)
        if tree is None:
            continue
        got = from_flat(tree) if layout == "flat" else tree
        want = {n: torch_opt.state[p][key] for n, p in params.items() if torch_opt.state[p].get(key) is not None}
        differ.update(f"state.{key}.{n}" for n in same_bits({n: got[n] for n in want}, want))
    return sorted(differ), {n: p.detach() for n, p in params.items()}, mine


# --------------------------------------------------------------------- AdamW with param groups


def warmup_cosine_torch(opt):
    return L.SequentialLR(
        opt, [L.LinearLR(opt, start_factor=1 / 10, total_iters=10), L.CosineAnnealingLR(opt, T_max=90, eta_min=1e-5)], milestones=[10]
    )


def warmup_cosine_fs(lr):
    return optim.warmup_cosine_schedule(lr, warmup_steps=10, steps=100, min_lr=1e-5)


@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("layout", ["tree", "flat"])
@pytest.mark.parametrize("case", list(CASES))
def test_adamw_groups_match_torch_param_groups(case, layout, schedule):
    groups = CASES[case]
    lr_of = warmup_cosine_fs if schedule else (lambda lr: lr)
    differ, final, _ = run_against_torch(
        lambda: optim.adamw(lr_of(BASE["lr"]), weight_decay=BASE["weight_decay"], groups=fs_groups(groups, lr_of)),
        lambda params: torch.optim.AdamW(torch_groups(params, groups, {}), **BASE),
        warmup_cosine_torch if schedule else None,
        layout,
    )
    assert not differ, f"{case} ({layout}, schedule={schedule}): differs from torch.optim.AdamW at {differ}"
    init = init_tensors()
    if case == "frozen_backbone" and not schedule:  # lr 0: the backbone never moves, the rest does
        assert all(torch.equal(final[n], init[n]) for n in SHAPES if n.startswith("backbone."))
        assert not torch.equal(final["head.weight"], init["head.weight"])


def test_the_groups_change_the_result():
    # The comparison above is not vacuous: without the mask, the biases end elsewhere.
    groups = CASES["decay_mask"]
    _, masked, _ = run_against_torch(
        lambda: optim.adamw(BASE["lr"], weight_decay=0.1, groups=fs_groups(groups)),
        lambda params: torch.optim.AdamW(torch_groups(params, groups, {}), **BASE),
        None,
        "tree",
        steps=5,
    )
    _, plain, _ = run_against_torch(
        lambda: optim.adamw(BASE["lr"], weight_decay=0.1),
        lambda params: torch.optim.AdamW(params.values(), **BASE),
        None,
        "tree",
        steps=5,
    )
    assert not torch.equal(masked["head.bias"], plain["head.bias"])
    assert torch.equal(masked["head.weight"], plain["head.weight"])


def test_flat_layout_cuts_through_leaves_of_two_groups():
    leaves, _ = flat_layout()
    owner = assign(SHAPES, CASES["all"])
    cut_leaf = [r.path for r in leaves.ranges["a"]][-1]
    assert cut_leaf == "backbone.0.weight" and leaves.ranges["b"][0].path == cut_leaf
    assert len({owner[r.path] for r in leaves.ranges["b"]}) == 4  # default, mask, backbone, head


# --------------------------------------------------------------------- schedules


def _schedule_cases():
    lr = 0.1
    return {
        "constant": (optim.constant_schedule(lr), None),
        "lambda": (optim.lambda_schedule(lr, lambda k: 0.95**k), lambda o: L.LambdaLR(o, lambda k: 0.95**k)),
        "linear_warmup": (optim.linear_schedule(lr, start_factor=0.05, steps=40), lambda o: L.LinearLR(o, start_factor=0.05, total_iters=40)),
        "linear_decay": (
            optim.linear_schedule(lr, start_factor=1.0, end_factor=0.0, steps=77),
            lambda o: L.LinearLR(o, start_factor=1.0, end_factor=0.0, total_iters=77),
        ),
        # T_max below the run: past it torch's cosine rises again (its special branch).
        "cosine": (optim.cosine_schedule(lr, steps=37, min_lr=1e-3), lambda o: L.CosineAnnealingLR(o, T_max=37, eta_min=1e-3)),
        "join": (
            optim.join_schedules(
                optim.linear_schedule(lr, start_factor=0.25, steps=8),
                optim.constant_schedule(lr),
                optim.cosine_schedule(lr, steps=60, min_lr=2e-3),
                boundaries=[8, 20],
            ),
            lambda o: L.SequentialLR(
                o,
                [L.LinearLR(o, start_factor=0.25, total_iters=8), L.LambdaLR(o, lambda k: 1.0), L.CosineAnnealingLR(o, T_max=60, eta_min=2e-3)],
                milestones=[8, 20],
            ),
        ),
        "warmup_cosine": (
            optim.warmup_cosine_schedule(lr, warmup_steps=10, steps=100, min_lr=1e-4),
            lambda o: L.SequentialLR(
                o, [L.LinearLR(o, start_factor=1 / 10, total_iters=10), L.CosineAnnealingLR(o, T_max=90, eta_min=1e-4)], milestones=[10]
            ),
        ),
        "warmup_linear": (
            optim.warmup_linear_schedule(lr, warmup_steps=10, steps=100),
            lambda o: L.SequentialLR(
                o,
                [L.LinearLR(o, start_factor=1 / 10, total_iters=10), L.LinearLR(o, start_factor=1.0, end_factor=0.0, total_iters=90)],
                milestones=[10],
            ),
        ),
    }


SCHEDULES = _schedule_cases()


def torch_lrs(make_scheduler, n: int, lr: float = 0.1) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    scheduler = make_scheduler(opt) if make_scheduler else None
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return out


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_gives_torch_lr_scheduler_floats(name):
    fresh = _schedule_cases()[name][0]  # its own cache, read out of order first
    schedule, make_scheduler = SCHEDULES[name]
    want = torch_lrs(make_scheduler, 600)
    counts = list(range(600))
    random.Random(0).shuffle(counts)
    assert [fresh(k) for k in counts] == [want[k] for k in counts]  # jumps, as a resumed run does
    assert [schedule(k) for k in range(600)] == want  # in order


def test_recursive_schedules_differ_from_their_closed_forms():
    # Why the recursion is replayed: torch's own numbers are not the closed formula's.
    cosine = optim.cosine_schedule(0.1, steps=300, min_lr=1e-3)
    closed = [1e-3 + (0.1 - 1e-3) * (1 + math.cos(math.pi * k / 300)) / 2 for k in range(300)]
    assert sum(cosine(k) != closed[k] for k in range(300)) > 100


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_adamw_under_each_schedule_matches_torch(name):
    schedule, make_scheduler = SCHEDULES[name]
    differ, _, _ = run_against_torch(
        lambda: optim.adamw(schedule, weight_decay=0.1),
        lambda params: torch.optim.AdamW(params.values(), lr=0.1, weight_decay=0.1),
        make_scheduler,
        "flat",
        dtype=torch.float64,
    )
    assert not differ, f"{name}: differs from torch.optim.AdamW + lr_scheduler at {differ}"


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match=r"start_factor must be in \(0, 1\]"):
        optim.linear_schedule(0.1, start_factor=0.0, steps=5)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        optim.cosine_schedule(0.1, steps=0)
    with pytest.raises(ValueError, match="boundaries must be increasing"):
        optim.join_schedules(optim.constant_schedule(0.1), optim.constant_schedule(0.2), boundaries=[0])
    with pytest.raises(ValueError, match="one boundary fewer"):
        optim.join_schedules(optim.constant_schedule(0.1), optim.constant_schedule(0.2), boundaries=[3, 4])
    with pytest.raises(ValueError, match=r"steps \(10\) must be an int > warmup_steps \(10\)"):
        optim.warmup_cosine_schedule(0.1, warmup_steps=10, steps=10)


# --------------------------------------------------------------------- SGD with param groups


SGD_GROUPS = [
    (("*.bias",), {"weight_decay": 0.0, "momentum": 0.0}),
    (("head.*",), {"lr": 0.05, "nesterov": True}),
    (("backbone.*",), {"dampening": 0.1, "momentum": 0.5}),
]


@pytest.mark.parametrize("layout", ["tree", "flat"])
def test_sgd_groups_match_torch_param_groups(layout):
    defaults = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    differ, _, _ = run_against_torch(
        lambda: optim.sgd(warmup_cosine_fs(0.1), momentum=0.9, weight_decay=0.01, groups=fs_groups(SGD_GROUPS, warmup_cosine_fs)),
        lambda params: torch.optim.SGD(torch_groups(params, SGD_GROUPS, {}), **defaults),
        warmup_cosine_torch,
        layout,
    )
    assert not differ, f"differs from torch.optim.SGD at {differ}"


# --------------------------------------------------------------------- from_torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Linear(5, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.stem(x))))


def _torch_run(model, opt, scheduler, steps):
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _fs_run(model, fs_opt, steps):
    tree = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    state = fs_opt.init(tree)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x, y = torch.randn(6, 5, generator=gen), torch.randint(0, 3, (6,), generator=gen)
        tree, state = fs_opt.update(_grads_by_module(model, tree, x, y), state, tree)
    return tree


def _grads_by_module(model, tree, x, y):
    """The gradient of the loss at `tree`, by the module itself (its `backward`)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in tree:
                p.copy_(tree[n])
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if n in tree}


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_from_torch_keeps_param_groups_and_scheduler(kind):
    torch.manual_seed(0)
    reference, copy = Net(), Net()
    copy.load_state_dict(reference.state_dict())
    copy.stem.requires_grad_(False)  # frozen: neither optimizer touches it
    reference.stem.requires_grad_(False)

    def build(model):
        no_decay = [model.norm.weight, model.norm.bias, model.head.bias]
        if kind == "adamw":
            opt = torch.optim.AdamW(
                [{"params": [model.head.weight]}, {"params": no_decay, "weight_decay": 0.0, "betas": (0.8, 0.9)}], lr=3e-2, weight_decay=0.2
            )
            return opt, warmup_cosine_torch(opt)
        opt = torch.optim.SGD([{"params": [model.head.weight], "nesterov": True}, {"params": no_decay, "lr": 0.01}], lr=0.1, momentum=0.9)
        return opt, L.LambdaLR(opt, [lambda k: 0.99**k, lambda k: 1.0 / (1 + k)])

    torch_opt, scheduler = build(reference)
    template_opt, template_scheduler = build(copy)
    fs_opt = optim.from_torch(template_opt, copy, template_scheduler)
    _torch_run(reference, torch_opt, scheduler, 40)
    got = _fs_run(copy, fs_opt, 40)
    want = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    assert set(got) == set(want) and not same_bits(got, want)


def test_from_torch_refuses_what_it_cannot_convert():
    model = Net()
    with pytest.raises(ValueError, match=r"parameters \['head.bias'\] are in no param group"):
        optim.from_torch(torch.optim.AdamW([p for n, p in model.named_parameters() if n != "head.bias"]), model)
    with pytest.raises(ValueError, match="an L2 penalty added to the gradient"):
        optim.from_torch(torch.optim.Adam(model.parameters(), weight_decay=0.1), model)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="no fs schedule for StepLR.*lambda_schedule"):
        optim.from_torch(opt, model, L.StepLR(opt, step_size=3))
    with pytest.raises(ValueError, match="not a parameter of the model given"):
        optim.from_torch(torch.optim.AdamW(Net().parameters()), model)
    with pytest.raises(TypeError, match="no fs equivalent of torch.optim.rmsprop.RMSprop"):
        optim.from_torch(torch.optim.RMSprop(model.parameters()), model)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="has already stepped"):
        optim.from_torch(opt, model)


# --------------------------------------------------------------------- errors


def test_a_rule_that_matches_no_leaf_is_an_error():
    params = {n: t for n, t in init_tensors().items()}
    with pytest.raises(ValueError, match=r"rule '\*\.bais' of groups\[0\] .* matches no leaf the optimizer updates.*head.bias"):
        optim.adamw(0.1, groups=[optim.group("*.bais", weight_decay=0.0)]).init(params)
    shadowed = [optim.group("*.bias", weight_decay=0.0), optim.group("head.bias", lr=0.0)]
    with pytest.raises(ValueError, match=r"groups\[1\] .* gets no leaf: every leaf it matches was taken by an earlier group"):
        optim.sgd(0.1, groups=shadowed).init(params)
    with pytest.raises(ValueError, match=r"sets \['betas'\], which is not a per-group hyperparameter.*'momentum'"):
        optim.sgd(0.1, groups=[optim.group("*", betas=(0.9, 0.9))])
    with pytest.raises(TypeError, match="make each group with fs.optim.group"):
        optim.adamw(0.1, groups=[{"params": ["head.bias"], "weight_decay": 0.0}])
    with pytest.raises(ValueError, match="sets no hyperparameter"):
        optim.group("*.bias")
    with pytest.raises(TypeError, match="a rule must be a glob"):
        optim.group(3, lr=0.1)


def test_rule_kinds_regex_and_function():
    params = init_tensors()
    leaves = optim.LeafLayout.of_tree(params)
    from functional_shard.optim._groups import resolve  # noqa: PLC0415 (the resolution itself)

    plan = resolve(
        [optim.group(re.compile(r"^backbone\.\d\."), lr=0.0), optim.group(lambda path, shape: len(shape) < 2, weight_decay=0.0)],
        leaves,
        "test",
    )
    assert plan.group_of["backbone.0.weight"] == 1 and plan.group_of["backbone.0.bias"] == 1
    assert plan.group_of["backbone.norm.weight"] == 2 and plan.group_of["scale"] == 2 and plan.group_of["head.weight"] == 0


def _mesh():
    return fs.analysis.AbstractMesh({"fsdp": 1})


def test_sharded_step_names_the_fs_equivalent_of_a_torch_optimizer():
    model = Net()
    loss_fn = lambda p, b: p  # noqa: E731 (never called)
    with pytest.raises(
        TypeError,
        match=re.escape("Use fs.optim.adamw(lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01) (the same update as this torch.optim.AdamW"),
    ) as error:
        fs.sharded_step(loss_fn, _mesh(), optimizer=torch.optim.AdamW(model.parameters()))
    assert "fs.optim.from_torch(torch_optimizer, model)" in str(error.value)
    with pytest.raises(TypeError, match=re.escape("fs.optim.sgd(lr=0.1, momentum=0.9, dampening=0, weight_decay=0, nesterov=False)")):
        fs.sharded_step(loss_fn, _mesh(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="got the lr scheduler .*CosineAnnealingLR. In fs a schedule is the optimizer's lr"):
        fs.sharded_step(loss_fn, _mesh(), optimizer=L.CosineAnnealingLR(opt, T_max=10))
    with pytest.raises(TypeError, match=r"got a GradientTransformation .*fs.optim.chain\(transformation"):
        fs.sharded_step(loss_fn, _mesh(), optimizer=optim.clip_by_global_norm(1.0))


# --------------------------------------------------------------------- a user's optimizer


def lion(lr, *, weight_decay=0.0, groups=()):
    """Lion with per-group lr and weight decay, from the public blocks (docs/training.md)."""
    defaults = {"lr": lr, "weight_decay": weight_decay}
    per_group = [defaults] + [{**defaults, **dict(g.options)} for g in groups]
    schedules = [optim.as_schedule(o["lr"]) for o in per_group]

    class State(NamedTuple):
        count: torch.Tensor  # updates applied so far
        exp_avg: Any  # momentum, like params

    def init(params, *, leaves=None):
        optim.check_params(params)
        return State(torch.zeros((), dtype=torch.int64), optim.zeros_like(params))

    def scalars(state):
        lrs = [s(int(state.count)) for s in schedules]
        return tuple({"lr": optim.scalar(lr), "decay": optim.scalar(1 - lr * o["weight_decay"])} for lr, o in zip(lrs, per_group))

    def apply(grads, state, params, scalars, *, inplace=False, mesh=None, leaves=None):
        def step_run(g, param, grad, exp_avg):
            c = exp_avg * 0.9 + grad * 0.1
            param.mul_(scalars[g]["decay"]).sub_(torch.sign(c) * scalars[g]["lr"])
            exp_avg.mul_(0.99).add_(grad * 0.01)

        new, states = optim.apply_per_group(
            step_run, grads, params, {"exp_avg": state.exp_avg}, groups=groups, leaves=leaves, inplace=inplace, owner="lion"
        )
        return new, State(state.count + 1, states["exp_avg"])

    return optim.make_optimizer(init, scalars, apply)


def test_a_users_optimizer_with_groups_on_flat_tensors_equals_whole_leaves():
    groups = [optim.group("*.bias", weight_decay=0.0), optim.group("head.*", lr=1e-3)]
    opt = lion(optim.cosine_schedule(1e-2, steps=20), weight_decay=0.5, groups=groups)
    leaves, _ = flat_layout()
    tree, flat = init_tensors(), to_flat(init_tensors())
    s_tree, s_flat = opt.init(tree), opt.init(flat, leaves=leaves)
    for i in range(20):
        tree, s_tree = opt.update(grads_at(i), s_tree, tree)
        flat, s_flat = opt.update(to_flat(grads_at(i)), s_flat, flat, leaves=leaves)
    assert not same_bits(from_flat(flat), tree)
    with pytest.raises(ValueError, match=r"lion: rule '\*\.bais'"):
        lion(0.1, groups=[optim.group("*.bais", weight_decay=0.0)]).update(grads_at(0), s_tree, tree)


# --------------------------------------------------------------------- in fs.sharded_step


def _build_mlp():
    torch.manual_seed(0)
    return MLP(13, 16, 5, n_blocks=3)


STEP_GROUPS = [
    optim.group("*.bias", weight_decay=0.0),
    optim.group("blocks.1.*", lr=warmup_cosine_fs(1e-3)),
    optim.group("blocks.0.fc2.*", "output_proj.*", betas=(0.8, 0.99)),
]


def _batch(i: int, n: int):
    g = torch.Generator().manual_seed(500 + i)
    return torch.randn(n, 13, generator=g), torch.randint(0, 5, (n,), generator=g)


def one_rank_against_torch(mesh, trace: bool, steps: int) -> dict:
    model = _build_mlp()
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        return F.cross_entropy(apply_fn(p, batch[0]), batch[1])

    opt = optim.adamw(warmup_cosine_fs(1e-2), weight_decay=0.1, groups=STEP_GROUPS)
    step = fs.sharded_step(loss_fn, mesh, optimizer=opt, schedule=fs.Schedule(trace=trace))
    state = step.init(params)
    reference = _build_mlp()
    named = dict(reference.named_parameters())
    owner = {n: next((i for i, g in enumerate(STEP_GROUPS) if g.matches(n, tuple(p.shape))), -1) for n, p in named.items()}
    torch_opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named.items() if owner[n] == -1]},
            {"params": [p for n, p in named.items() if owner[n] == 0], "weight_decay": 0.0},
            {"params": [p for n, p in named.items() if owner[n] == 1], "lr": 1e-3},
            {"params": [p for n, p in named.items() if owner[n] == 2], "betas": (0.8, 0.99)},
        ],
        lr=1e-2,
        weight_decay=0.1,
    )
    scheduler = warmup_cosine_torch(torch_opt)
    for i in range(steps):
        batch = _batch(i, 8)
        state, _ = step(state, batch)
        torch_opt.zero_grad()
        F.cross_entropy(reference(batch[0]), batch[1]).backward()
        torch_opt.step()
        scheduler.step()
    full = fs.gather(state.params)
    return {"differ": [n for n, p in named.items() if not torch.equal(full[n], p.detach())]}


@pytest.mark.parametrize("trace", [True, False])
def test_one_rank_step_with_groups_and_schedule_matches_torch(local_world, trace):
    # 30 steps: the warmup (10) and into the cosine; the optimizer-level tests above run 100.
    report = local_world(1).run(one_rank_against_torch, trace, 30)[0]
    assert not report["differ"], report


@pytest.mark.slow
def test_one_rank_step_with_groups_and_schedule_matches_torch_100_steps(local_world):
    report = local_world(1).run(one_rank_against_torch, True, STEPS)[0]
    assert not report["differ"], report


def two_ranks_groups_on_cut_shards(mesh, steps: int) -> dict:
    """Each step's update of the flat shards against the per-leaf update of the same gradient."""
    model = _build_mlp()
    apply_fn, params = fs.functionalize(model)

    def loss_fn(p, batch):
        return F.cross_entropy(apply_fn(p, batch[0]), batch[1])

    make = lambda: optim.adamw(warmup_cosine_fs(1e-2), weight_decay=0.1, groups=STEP_GROUPS)  # noqa: E731
    report: dict = {}
    runs = {}
    for arm, (trace, donate) in {"eager": (False, False), "traced": (True, False), "donated": (True, True)}.items():
        step = fs.sharded_step(loss_fn, mesh, optimizer=make(), schedule=fs.Schedule(trace=trace), donate=donate)
        state = step.init(params)
        if arm == "eager":  # the cut: a leaf across a shard boundary, a shard with several groups
            layout = state.params.layout
            mine = optim.LeafLayout.of_shards(layout, mesh.shard_index)
            numel = {p: math.prod(s) for p, s in zip(mine.paths, mine.shapes)}
            report["cut_leaves"] = [(n, r.path) for n, ranges in mine.ranges.items() for r in ranges if r.stop - r.start < numel[r.path]]
            group_of = lambda path: next((i for i, g in enumerate(STEP_GROUPS) if g.matches(path, ())), -1)  # noqa: E731
            report["groups_per_shard"] = {n: len({group_of(r.path) for r in ranges}) for n, ranges in mine.ranges.items()}
        trainable = list(params.trainable)
        ref_opt = make()
        ref = {n: params.trainable[n].detach().clone() for n in trainable}
        ref_state = ref_opt.init(ref)
        equal = True
        for i in range(steps):
            batch = _batch(mesh.rank * 100 + i, 4)
            grads = fs.gather(step.grad(state, batch)[0])
            ref, ref_state = ref_opt.update({n: grads[n] for n in trainable}, ref_state, ref)
            state, _ = step(state, batch)
            full = fs.gather(state.params)
            equal = equal and all(torch.equal(full[n], ref[n]) for n in trainable)
        report[f"{arm}_equals_per_leaf"] = equal
        runs[arm] = [t.clone() for t in fs.tree_leaves((fs.gather(state.params), state.opt_state))]
    report["traced_equals_eager"] = all(torch.equal(a, b) for a, b in zip(runs["traced"], runs["eager"]))
    report["donated_equals_eager"] = all(torch.equal(a, b) for a, b in zip(runs["donated"], runs["eager"]))
    return report


def test_two_ranks_groups_cut_through_shards_traced_equals_eager(local_world):
    reports = local_world(2).run(two_ranks_groups_on_cut_shards, 3)
    rank1 = reports[1]
    # input_proj.weight (208 elements) crosses the boundary of its 224-element buffer; the second
    # shard holds it and the bias (no decay); block 0's second shard holds fc2 (betas) and fc1.bias.
    assert ("input", "input_proj.weight") in rank1["cut_leaves"], rank1
    assert rank1["groups_per_shard"]["input"] >= 2 and rank1["groups_per_shard"]["blocks.0"] >= 2, rank1
    for rank, report in enumerate(reports):
        assert report["eager_equals_per_leaf"] and report["traced_equals_per_leaf"] and report["donated_equals_per_leaf"], (rank, report)
        assert report["traced_equals_eager"] and report["donated_equals_eager"], (rank, report)


def init_error_on_rank(mesh) -> str:
    apply_fn, params = fs.functionalize(_build_mlp())
    opt = optim.adamw(1e-3, groups=[optim.group("*.bias", weight_decay=0.0), optim.group("encoder.*", lr=0.0)])
    step = fs.sharded_step(lambda p, b: apply_fn(p, b).sum(), mesh, optimizer=opt, schedule=fs.Schedule(trace=False))
    try:
        step.init(params)
    except ValueError as error:
        return str(error)
    return "no error"


def test_step_init_names_a_rule_that_matches_no_leaf():
    message = fs.testing.SimulatedWorld(1).run(init_error_on_rank)[0]
    assert "rule 'encoder.*' of groups[1]" in message and "matches no leaf the optimizer updates" in message
    assert "input_proj.weight" in message


def test_chain_passes_the_leaf_layout_to_a_grouped_optimizer():
    groups = fs_groups(CASES["all"])
    opt = optim.chain(optim.clip_by_global_norm(1e9), optim.adamw(0.01, weight_decay=0.1, groups=groups))
    leaves, _ = flat_layout()
    tree, flat = init_tensors(), to_flat(init_tensors())
    s_tree, s_flat = opt.init(tree), opt.init(flat, leaves=leaves)
    for i in range(10):
        tree, s_tree = opt.update(grads_at(i), s_tree, tree)
        flat, s_flat = opt.update(to_flat(grads_at(i)), s_flat, flat, leaves=leaves)
    assert not same_bits(from_flat(flat), tree)

"""A suite's reward composition, chosen in gin: turns one group of graded responses into final
rewards (RECIPE §3 R = R_task + w_lang·R_lang − w_len·R_len, lexicographic / gated combination,
§5 Kimi group length reward).  Pure Python, no JAX: runs on rollout workers after grading and
before advantages.

Each suite binds its own spec with a gin scope, e.g. `arith/RewardSpec.length = "kimi"`; the
default `RewardSpec()` is the identity (every Grade returned unchanged).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping, Sequence
from typing import Protocol

import gin

from hcjax.rewards import compose, shaping
from hcjax.rewards.types import Grade

COMPOSITIONS = ("sum", "lexicographic", "gated")
LENGTH_MODES = ("none", "mai", "kimi", "shortest")

# Names of the components this module adds to every non-aborted Grade it rewrites.
TASK = "task"  # the grader's own reward
LANG = "lang"  # R_lang (eq. 11), before w_lang
LENGTH_COMPONENT = {"mai": "len_mai", "kimi": "len_kimi", "shortest": "len_shortest"}


class LengthSchedule(Protocol):
    """What the spec needs from a length curriculum (`hcjax.rl.curriculum.LengthCurriculum` fits;
    named structurally so that rewards does not import the rl layer above it)."""

    def max_length(self, step: int) -> int: ...

    def length_penalty_weight(self, step: int) -> float: ...


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """How a suite turns a group's Grades into rewards.

    composition: "sum": Σ_k weights[k]·c_k over the named components; "lexicographic": the
      components in `priority` order, combined over the group by `compose.lexicographic` (a
      lower level acts only when the group ties on every higher one, within `tie_atol`);
      "gated": the weighted sum, replaced by `gate_minimum` when any (component, threshold) in
      `gates` is below its threshold — applied last, so a failed gate overrides the shaping terms.
    weights: component name -> weight for "sum" / "gated"; None means {"task": 1.0}. The
      components are the grader's own plus "task" (the grader's reward).
    length: "none"; "mai": subtract w_len·ρ_q·|y|/ℓ_max (ρ_q the group's pass rate); "kimi": add
      w·λ_i (Kimi k1.5 group length reward); "shortest": subtract the shortest-correct penalty
      (`shaping.shortest_correct_penalties` with weight w).
    length_weight: w above (RECIPE §3: w_len = 0.25); with a `curriculum` its
      `length_penalty_weight(step)` replaces it, and its `max_length(step)` supplies ℓ_max when
      the caller gives none.
    length_warmup_steps: the length term is zero before this learner step (Kimi: warm up
      without it, then enable).
    language_weight, language_alpha: add w_lang·max(1 − α·n_non_english_words(text), 0)
      (RECIPE eq. 11: w_lang = 0.5, α = 0.005); needs the decoded texts.
    """

    composition: str = "sum"
    weights: Mapping[str, float] | None = None
    priority: Sequence[str] = ()
    tie_atol: float = 0.0
    gates: Sequence[tuple[str, float]] = ()
    gate_minimum: float = 0.0
    length: str = "none"
    length_weight: float = 0.25
    length_warmup_steps: int = 0
    curriculum: LengthSchedule | None = None
    language_weight: float = 0.0
    language_alpha: float = 0.005

    def __post_init__(self) -> None:
        if self.composition not in COMPOSITIONS:
            raise ValueError(f"RewardSpec.composition={self.composition!r} is not one of "
                             f"{COMPOSITIONS}")
        if self.length not in LENGTH_MODES:
            raise ValueError(f"RewardSpec.length={self.length!r} is not one of {LENGTH_MODES}")
        self._check_weights()
        self._check_priority()
        self._check_gates()
        for name in ("length_weight", "language_weight", "language_alpha", "tie_atol"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ValueError(f"RewardSpec.{name}={value!r} is not a non-negative number "
                                 "(the sign of its term is fixed by the formula)")
        if not isinstance(self.length_warmup_steps, int) or self.length_warmup_steps < 0:
            raise ValueError(f"RewardSpec.length_warmup_steps={self.length_warmup_steps!r} is "
                             "not a non-negative int")
        if not _is_number(self.gate_minimum):
            raise ValueError(f"RewardSpec.gate_minimum={self.gate_minimum!r} is not a number")
        if self.curriculum is not None and self.length == "none":
            raise ValueError("RewardSpec.curriculum is set but length='none': the curriculum "
                             "only supplies the length term's weight and ℓ_max")

    def _check_weights(self) -> None:
        if self.weights is None:
            object.__setattr__(self, "weights", {TASK: 1.0})
            return
        if self.composition == "lexicographic":
            raise ValueError(f"RewardSpec.weights={dict(self.weights)!r} is unused by "
                             "composition='lexicographic' (it uses `priority`)")
        if not isinstance(self.weights, Mapping) or not self.weights:
            raise ValueError(f"RewardSpec.weights={self.weights!r} is not a non-empty mapping "
                             "of component name -> weight")
        for name, w in self.weights.items():
            if not isinstance(name, str) or not _is_number(w):
                raise ValueError(f"RewardSpec.weights entry {name!r}: {w!r} is not "
                                 "str -> number")
        # Negative weights are allowed: a component may count against the reward (errors, ...).
        object.__setattr__(self, "weights", dict(self.weights))

    def _check_priority(self) -> None:
        if isinstance(self.priority, str):
            raise ValueError(f"RewardSpec.priority={self.priority!r} is a string; expected a "
                             "sequence of component names")
        priority = tuple(self.priority)
        if self.composition == "lexicographic":
            if not priority:
                raise ValueError("RewardSpec.priority=() is empty; composition='lexicographic' "
                                 "needs the component names in priority order")
            if any(not isinstance(p, str) for p in priority) or len(set(priority)) != len(
                    priority):
                raise ValueError(f"RewardSpec.priority={priority!r} is not a sequence of "
                                 "distinct component names")
        elif priority:
            raise ValueError(f"RewardSpec.priority={priority!r} is only used by "
                             f"composition='lexicographic', not {self.composition!r}")
        object.__setattr__(self, "priority", priority)

    def _check_gates(self) -> None:
        gates = []
        for gate in self.gates:
            if (not isinstance(gate, Sequence) or isinstance(gate, str) or len(gate) != 2
                    or not isinstance(gate[0], str) or not _is_number(gate[1])):
                raise ValueError(f"RewardSpec.gates entry {gate!r} is not a (component name, "
                                 "numeric threshold) pair")
            gates.append((gate[0], float(gate[1])))
        if self.composition == "gated" and not gates:
            raise ValueError("RewardSpec.gates=() is empty; composition='gated' needs "
                             "(component, threshold) pairs")
        if self.composition != "gated" and gates:
            raise ValueError(f"RewardSpec.gates={gates!r} is only used by composition='gated', "
                             f"not {self.composition!r}")
        object.__setattr__(self, "gates", tuple(gates))

    def __hash__(self) -> int:
        # `weights` is a dict; hash its items so a spec can sit inside frozen, hashed configs.
        return hash(tuple(tuple(sorted(self.weights.items())) if f.name == "weights"
                          else getattr(self, f.name) for f in dataclasses.fields(self)))

    @property
    def is_identity(self) -> bool:
        """True when every reward passes through unchanged (the default spec)."""
        return (self.composition == "sum" and self.weights == {TASK: 1.0}
                and self.length == "none" and self.language_weight == 0.0)

    def length_term_weight(self, step: int) -> float:
        """The length term's weight at learner `step`: 0 during warm-up, else the curriculum's
        w_len when one is given, else `length_weight`."""
        if self.length == "none" or step < self.length_warmup_steps:
            return 0.0
        if self.curriculum is not None:
            return float(self.curriculum.length_penalty_weight(step))
        return float(self.length_weight)

    def group_rewards(self, grades: Sequence[Grade], lengths: Sequence[int], *,
                      max_length: int | None = None, step: int = 0,
                      texts: Sequence[str] | None = None) -> list[Grade]:
        """Final rewards for one group (all responses to one prompt), in input order.

        grades: the suite grader's Grades; lengths: response lengths in tokens; max_length: ℓ_max
        the group was sampled with (for length="mai"; defaults to `curriculum.max_length(step)`);
        step: the learner step (warm-up, curriculum); texts: decoded responses (needed when
        language_weight > 0).  Aborted Grades are returned as they are and left out of every
        group statistic (pass rate, min/max length, lexicographic ties).  The others get the
        composed `reward` and `components` = the grader's + "task" + each term added ("lang",
        "len_mai" / "len_kimi" / "len_shortest", unweighted); `correct` and `reason` are kept.
        """
        if len(lengths) != len(grades):
            raise ValueError(f"len(lengths)={len(lengths)} != len(grades)={len(grades)}")
        if texts is not None and len(texts) != len(grades):
            raise ValueError(f"len(texts)={len(texts)} != len(grades)={len(grades)}")
        if step < 0:
            raise ValueError(f"step={step} is negative")
        if self.is_identity:
            return list(grades)
        if self.language_weight > 0 and texts is None:
            raise ValueError(f"RewardSpec.language_weight={self.language_weight} needs the "
                             "decoded texts; group_rewards got texts=None")
        live = [i for i, g in enumerate(grades) if not g.aborted]
        if not live:
            return list(grades)
        for i in live:
            if not isinstance(lengths[i], numbers.Integral) or lengths[i] < 0:
                raise ValueError(f"lengths[{i}]={lengths[i]!r} is not a non-negative int")

        comps = [self._components(i, grades[i]) for i in live]
        base = self._compose(comps)
        terms = self._length_terms([lengths[i] for i in live],
                                   [bool(grades[i].correct) for i in live],
                                   max_length=max_length, step=step)
        out = list(grades)
        for j, i in enumerate(live):
            reward = base[j]
            if self.language_weight > 0:
                comps[j][LANG] = shaping.language_reward(texts[i], self.language_alpha)
                reward += self.language_weight * comps[j][LANG]
            if terms is not None:
                w, values = terms
                comps[j][LENGTH_COMPONENT[self.length]] = values[j]
                # Kimi's λ is a reward; the MAI and shortest-correct terms are penalties.
                reward += w * values[j] if self.length == "kimi" else -w * values[j]
            if self.composition == "gated":
                reward = compose.gated(reward, [(comps[j][name], t) for name, t in self.gates],
                                       self.gate_minimum)
            out[i] = dataclasses.replace(grades[i], reward=float(reward), components=comps[j])
        return out

    def _components(self, index: int, grade: Grade) -> dict[str, float]:
        comps = {**grade.components}
        if TASK in comps and comps[TASK] != grade.reward:
            raise ValueError(f"grades[{index}].components['task']={comps[TASK]} differs from its "
                             f"reward={grade.reward}; 'task' is reserved for the grader's reward")
        comps[TASK] = float(grade.reward)
        needed = (list(self.priority) if self.composition == "lexicographic"
                  else list(self.weights) + [name for name, _ in self.gates])
        missing = [name for name in needed if name not in comps]
        if missing:
            raise ValueError(f"RewardSpec names components {missing} that grades[{index}] lacks; "
                             f"it has {sorted(comps)}")
        return comps

    def _compose(self, comps: list[dict[str, float]]) -> list[float]:
        if self.composition == "lexicographic":
            return compose.lexicographic([[c[p] for p in self.priority] for c in comps],
                                         atol=self.tie_atol)
        return [compose.weighted_sum({k: c[k] for k in self.weights}, self.weights)
                for c in comps]

    def _length_terms(self, lengths: list[int], correct: list[bool], *, max_length: int | None,
                      step: int) -> tuple[float, list[float]] | None:
        """(weight, unweighted term per live response), or None when there is no length term.
        The term is still computed (and logged) during warm-up, with weight 0."""
        if self.length == "none":
            return None
        w = self.length_term_weight(step)
        if self.length == "mai":
            if max_length is None:
                if self.curriculum is None:
                    raise ValueError("RewardSpec.length='mai' needs max_length (ℓ_max) or a "
                                     "curriculum; got neither")
                max_length = self.curriculum.max_length(step)
            pass_rate = sum(correct) / len(correct)
            return w, [shaping.mai_length_penalty(n, pass_rate, max_length) for n in lengths]
        if self.length == "kimi":
            return w, shaping.kimi_length_rewards(lengths, correct)
        # "shortest": weight 1 here so the component is the unweighted penalty.
        return w, shaping.shortest_correct_penalties(lengths, correct, weight=1.0)

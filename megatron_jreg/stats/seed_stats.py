"""Is JREG better than the baseline across seeds? A one-sample one-sided t-test.

For paired per-seed scores, d_i = jreg_i - baseline_i, the test is

    t = mean(d) / (sd(d) / sqrt(n)),   df = n - 1,   H1: mean(d) > 0
    p = P(T_df >= t),   lower bound of the one-sided 95% interval = mean(d) - t_{0.95, df} * se

scipy computes the Student t tail when it is installed; otherwise an exact
implementation here does (regularized incomplete beta by Lentz's continued fraction,
quantile by bisection), accurate to about 1e-12.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Sequence, Tuple

from megatron_jreg.errors import InputError, missing_extra
from megatron_jreg.stats.pairing import LeftOut, ordered
from megatron_jreg.stats.score_scale import check_accuracy, check_scales

BACKENDS = ("auto", "scipy", "exact")


# ---------------------------------------------------------------- exact Student t


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), evaluated with the modified Lentz method."""
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),  # even step
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),  # odd step
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            delta = d * c
            h *= delta
        if abs(delta - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0):
        raise ValueError(f"incomplete beta needs a, b > 0, got a={a}, b={b}")
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    front = math.exp(log_front)
    # The fraction converges fast for x < (a+1)/(a+b+2); use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_sf_exact(t: float, df: float) -> float:
    """P(T_df >= t), the upper tail of Student's t."""
    if df <= 0:
        raise ValueError(f"t distribution: df must be > 0, got {df}")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))  # P(T >= |t|)
    return tail if t >= 0 else 1.0 - tail


def t_ppf_exact(q: float, df: float) -> float:
    """The q-quantile of Student's t (the t with P(T_df <= t) = q), by bisection."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"t quantile: q must be in (0, 1), got {q}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_ppf_exact(1.0 - q, df)
    target = 1.0 - q  # find t > 0 with sf(t) = target; sf decreases in t
    lo, hi = 0.0, 1.0
    while t_sf_exact(hi, df) > target:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_sf_exact(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


# ---------------------------------------------------------------- backend dispatch


def _scipy_t():
    try:
        from scipy import stats
    except ImportError:
        return None
    return stats.t


def resolve_backend(backend: str = "auto") -> str:
    """ "scipy" or "exact"; an explicit "scipy" without scipy installed is an error."""
    if backend not in BACKENDS:
        raise InputError(f"t-test backend {backend!r}: choose one of {BACKENDS}")
    if backend == "exact":
        return "exact"
    if _scipy_t() is None:
        if backend == "scipy":
            raise missing_extra("scipy", "stats", "the scipy t-test backend")
        return "exact"
    return "scipy"


def t_sf(t: float, df: float, backend: str = "auto") -> float:
    if resolve_backend(backend) == "scipy":
        return float(_scipy_t().sf(t, df))
    return t_sf_exact(t, df)


def t_ppf(q: float, df: float, backend: str = "auto") -> float:
    if resolve_backend(backend) == "scipy":
        return float(_scipy_t().ppf(q, df))
    return t_ppf_exact(q, df)


# ---------------------------------------------------------------- the test


@dataclass(frozen=True)
class OneSidedTTest:
    """The result of testing H1: mean difference > 0."""

    n: int
    mean_difference: float
    std_difference: float
    t: float
    df: int
    p_value: float
    lower_bound: float
    confidence: float
    backend: str

    def to_dict(self) -> Dict[str, float]:
        return asdict(self)


_OVERFLOW = (
    "the scores are too large to average in floating point (overflow); check the scores' values"
)


def one_sided_t_test(
    differences: Sequence[float], confidence: float = 0.95, backend: str = "auto"
) -> OneSidedTTest:
    """One-sample one-sided t-test of mean(differences) > 0 (differences = jreg - baseline)."""
    n = len(differences)
    if n < 2:
        raise InputError(f"a t-test needs at least 2 paired scores, got {n}; add seeds")
    if not 0.0 < confidence < 1.0:
        raise InputError(f"confidence must be in (0, 1), got {confidence}")
    used = resolve_backend(backend)
    try:
        mean = math.fsum(differences) / n
        sd = math.sqrt(math.fsum((d - mean) ** 2 for d in differences) / (n - 1))
    except (OverflowError, ValueError):  # fsum raises ValueError for inf - inf
        mean = sd = math.inf
    if not (math.isfinite(mean) and math.isfinite(sd)):
        raise InputError(_OVERFLOW)
    se = sd / math.sqrt(n)
    df = n - 1
    if se == 0.0:  # identical differences: the sign of the mean decides
        t = math.copysign(math.inf, mean) if mean != 0 else math.nan
        p = math.nan if mean == 0 else (0.0 if mean > 0 else 1.0)
        lower = mean
    else:
        t = mean / se
        p = t_sf(t, df, used)
        lower = mean - t_ppf(confidence, df, used) * se
    return OneSidedTTest(
        n=n,
        mean_difference=mean,
        std_difference=sd,
        t=t,
        df=df,
        p_value=p,
        lower_bound=lower,
        confidence=confidence,
        backend=used,
    )


def paired_one_sided_t_test(
    baseline: Sequence[float],
    jreg: Sequence[float],
    confidence: float = 0.95,
    backend: str = "auto",
) -> OneSidedTTest:
    if len(baseline) != len(jreg):
        raise InputError(
            f"{len(baseline)} baseline scores but {len(jreg)} JREG scores; pair them by seed"
        )
    return one_sided_t_test([j - b for b, j in zip(baseline, jreg)], confidence, backend)


# ---------------------------------------------------------------- per-seed score files

class SeedScores(Dict[str, Dict[str, Tuple[float, float]]]):
    """Per task: {seed: (baseline, jreg)}; ``left_out``: what pairing the two sides left
    out (a reader of both sides' files fills it in)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.left_out = LeftOut()


_WIDE = re.compile(r"^(?P<task>.+?)[_:.](?P<arm>baseline|jreg)$", re.IGNORECASE)


def _number(text: str, where: str, column: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise InputError(f"{where}: column {column!r} holds {text!r}, expected a number") from None
    if not math.isfinite(value):
        raise InputError(f"{where}: column {column!r} holds {text!r}, expected a finite number")
    return value


def read_seed_scores(path: str) -> SeedScores:
    """Read per-seed scores from a CSV, long or wide.

    Long: columns ``baseline`` and ``jreg``, optionally ``seed`` and ``task`` (one row
    per seed and task). Wide: ``seed`` and two columns per task, ``<task>_baseline`` and
    ``<task>_jreg`` (``:`` or ``.`` also separate). A row without a seed gets its row number.
    Scores are accuracies in percent: a value outside [0, 100], or a task in fractions on
    one side and percent on the other, is refused (``stats.score_scale``).
    """
    try:
        f = open(path, newline="", encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file; give the CSV of per-seed scores") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory; give the CSV of per-seed scores") from None
    with f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        lower = {h.lower(): h for h in header}
        rows = list(reader)
    scores = SeedScores()

    def put(task: str, seed: str, pair: Tuple[float, float], where: str) -> None:
        per_task = scores.setdefault(task, {})
        if seed in per_task:
            raise InputError(f"{where}: seed {seed} appears twice for task {task!r}")
        for side, value in zip(("baseline", "jreg"), pair):
            check_accuracy(value, f"{where}: task {task}, seed {seed}, {side}")
        per_task[seed] = pair

    if "baseline" in lower and "jreg" in lower:
        for i, row in enumerate(rows, start=2):
            where = f"{path}:{i}"
            seed = (row.get(lower.get("seed", ""), "") or str(i - 1)).strip()
            task = (row.get(lower.get("task", ""), "") or "score").strip()
            pair = (
                _number(row[lower["baseline"]], where, "baseline"),
                _number(row[lower["jreg"]], where, "jreg"),
            )
            put(task, seed, pair, where)
    else:
        arms: Dict[str, Dict[str, str]] = {}
        for h in header:
            m = _WIDE.match(h)
            if m:
                arms.setdefault(m.group("task"), {})[m.group("arm").lower()] = h
        tasks = {t: cols for t, cols in arms.items() if len(cols) == 2}
        if not tasks:
            raise InputError(
                f"{path}: header {header} has neither 'baseline' and 'jreg' columns nor "
                "'<task>_baseline'/'<task>_jreg' pairs; see docs/evaluation.md for the format"
            )
        unpaired = sorted(set(arms) - set(tasks))
        if unpaired:
            raise InputError(f"{path}: tasks {unpaired} lack their baseline or jreg column")
        for i, row in enumerate(rows, start=2):
            where = f"{path}:{i}"
            seed = (row.get(lower.get("seed", ""), "") or str(i - 1)).strip()
            for task, cols in tasks.items():
                pair = (
                    _number(row[cols["baseline"]], where, cols["baseline"]),
                    _number(row[cols["jreg"]], where, cols["jreg"]),
                )
                put(task, seed, pair, where)
    if not scores:
        raise InputError(f"{path}: no score rows below the header")
    try:
        check_scales(scores)
    except InputError as err:
        raise InputError(f"{path}: {err}") from None
    return scores


def left_out_of(scores: SeedScores) -> LeftOut:
    """What the tests of ``scores`` leave out: what pairing left out (``scores.left_out``)
    and the seeds the average over tasks cannot use (not scored on every task)."""
    left = getattr(scores, "left_out", None)
    left = LeftOut() if left is None else left
    if len(scores) < 2:
        return left
    seeds = set().union(*(set(p) for p in scores.values()))
    common = set.intersection(*(set(p) for p in scores.values()))
    return replace(left, average=ordered(seeds - common), no_average=len(common) < 2)


def compare_seed_scores(
    scores: SeedScores, confidence: float = 0.95, backend: str = "auto",
    allow_unpaired: bool = False,
) -> List[Tuple[str, OneSidedTTest]]:
    """The test per task, then on the per-seed average over tasks ("average").

    The average uses the seeds that have a score for every task. Scores that pairing left
    out, or that the average cannot use, are refused (InputError naming them) unless
    ``allow_unpaired``; :func:`left_out_of` lists them.
    """
    left = left_out_of(scores)
    if left and not allow_unpaired:
        raise InputError(left.refusal())
    results = []
    for task, per_seed in scores.items():
        seeds = sorted(per_seed)
        results.append(
            (
                task,
                paired_one_sided_t_test(
                    [per_seed[s][0] for s in seeds],
                    [per_seed[s][1] for s in seeds],
                    confidence,
                    backend,
                ),
            )
        )
    if len(scores) > 1:
        common = sorted(set.intersection(*(set(p) for p in scores.values())))
        if len(common) >= 2:
            try:
                base = [math.fsum(scores[t][s][0] for t in scores) / len(scores) for s in common]
                jreg = [math.fsum(scores[t][s][1] for t in scores) / len(scores) for s in common]
            except OverflowError:
                raise InputError(_OVERFLOW) from None
            results.append(("average", paired_one_sided_t_test(base, jreg, confidence, backend)))
    return results


def format_seed_table(results: Sequence[Tuple[str, OneSidedTTest]]) -> str:
    if not results:
        return ""
    conf = int(round(results[0][1].confidence * 100))
    width = max(len("task"), *(len(task) for task, _ in results))
    lines = [
        f"{'task':<{width}}  {'n':>3}  {'mean diff':>10}  {'t':>8}  {'df':>3}  "
        f"{'p (one-sided)':>13}  {f'{conf}% lower':>10}"
    ]
    for task, r in results:
        lines.append(
            f"{task:<{width}}  {r.n:>3}  {r.mean_difference:+10.4f}  {r.t:8.3f}  {r.df:>3}  "
            f"{r.p_value:13.6f}  {r.lower_bound:+10.4f}"
        )
    lines.append(f"diff = jreg - baseline; H1: mean diff > 0; backend: {results[0][1].backend}")
    return "\n".join(lines)

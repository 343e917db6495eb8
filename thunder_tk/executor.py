"""The `tk` executor: claims symbols for tk's kernels and hands the rest to the right Thunder executor.

`thunder.jit(model, executors=[tk])` is meant to be complete on its own:
- symbols whose claim rule accepts run on tk's kernels;
- an attention that tk declines goes to Thunder's cuDNN or SDPA executor (not to the decomposed math);
- in a training trace tk takes a symbol only together with its gradient: where tk could run the forward but
  this build has no backward kernel, the executor that takes the gradient takes the forward too (see
  `get_grad_transform`); a trace compiled without gradients (inference, torch.no_grad) runs tk's forward;
- the remaining elementwise and reduction work is fused by nvFuser when Thunder can load it, else by
  Thunder's torch.compile executor (a private instance that never swallows the distributed collectives);
- declined GEMMs and collectives stay with the torch executor (cuBLAS, NCCL).

In an explicit list (``[tk, *thunder.get_default_executors()]``, ``["tk", "nvfuser"]``) tk delegates only
what no later executor in the list would take: a listed fuser or attention executor keeps its own work.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property

from thunder.core.compile_data import _compile_data, get_compile_data
from thunder.core.proxies import TensorProxy, pyval
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import get_tracectx
from thunder.distributed import prims as dist_prims
from thunder.extend import Executor, FusionExecutor, ImplInfo, OperatorExecutor, get_executor, register_executor

from thunder_tk import claim_rules
from thunder_tk.claim_rules import ClaimRule, Verdict
from thunder_tk.version import __version__

# Executors that take an attention tk declines, in order of preference.
ATTENTION_FALLBACKS = ("cudnn", "sdpa")

# Fusion executors that only fuse regions holding particular ops, so they do not replace a general fuser.
_SPECIALISED_FUSERS = ("torchcompile_cat", "torchcompile_xentropy")

# Thunder's distributed prims never go into a fusion region (async work handles break torch.compile).
COLLECTIVE_IDS = frozenset(dist_prims.PrimIDs)


def _sdpa_shape_problem(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None
                        ) -> str | None:
    """What Thunder 0.2.6's `sdpa` executor accepts in its checker but then fails on while tracing: its
    memory-efficient kernel (the one it picks for an attn_mask) takes no broadcast batch, so q, k, v and the mask
    must share dim 0, and each head count must be q's or 1 (its grad-forward meta asserts both). Called like the
    executor's checker."""
    tensors = [t for t in (query, key, value, attn_mask) if isinstance(t, TensorProxy)]
    if any(t.ndim != 4 for t in tensors):
        return None  # not the shapes this rule is about; Thunder's own checks apply
    batch, heads = tensors[0].shape[0], tensors[0].shape[1]
    if any(t.shape[0] != batch for t in tensors):
        return ("its memory-efficient kernel needs one batch size for q, k, v and the mask (got "
                f"{', '.join(str(t.shape[0]) for t in tensors)})")
    if any(t.shape[1] not in (heads, 1) for t in tensors):
        return "its memory-efficient kernel needs each head count to be q's or 1"
    return None


# Inputs a fallback executor's checker accepts but its transforms then fail on (a trace-time error that would end
# the user's jit), each called with the symbol's arguments like the checker: tk passes the symbol over to the next
# executor, or to Thunder's decomposition, saying why.
FALLBACK_SHAPE_LIMITS = {"sdpa": _sdpa_shape_problem}


def _unmasking(transform: Callable) -> Callable:
    """`transform` called with the SDPA arguments' constant mask replaced by is_causal, as it was judged."""

    def unmasked(*args, **kwargs):
        found = claim_rules.sdpa_without_mask(args, kwargs)
        if found is None:
            raise AssertionError("an attention mask judged constant is no longer recognised")
        return transform(*found[0], **found[1])

    return unmasked


def is_general_fuser(ex: Executor) -> bool:
    return isinstance(ex, FusionExecutor) and ex.name not in _SPECIALISED_FUSERS


@dataclass(frozen=True)
class Decision:
    """One judgement of a claimable symbol, as `explain` reports it."""

    symbol: str
    family: str
    inputs: str  # "bf16[2, 16, 1024, 128], ..., is_causal=True"
    site: "Site"  # tags the symbol's result proxies, to find what ran it in the final traces
    claimed_by: str | None  # "tk", a fallback executor's name, or None
    reason: str  # why tk declined ("" when tk claimed it)


@dataclass(frozen=True)
class _Route:
    rule: ClaimRule
    verdict: Verdict
    fallback: Executor | None  # set when tk declined and this executor takes the symbol
    # The fallback is called with a constant causal or all-keep attn_mask replaced by is_causal
    # (claim_rules.sdpa_without_mask).
    mask_dropped: bool = False

    @property
    def taken(self) -> bool:
        return bool(self.verdict) or self.fallback is not None


class TKExecutor(FusionExecutor):
    def __init__(self, rules: tuple[ClaimRule, ...]):
        super().__init__("tk", version=__version__)
        self._last_site: Site | None = None
        self._last_judged: BoundSymbol | None = None
        self._rules: dict[Hashable, ClaimRule] = {r.symbol_id: r for r in rules}
        for r in rules:
            self.implmap[r.symbol_id] = ImplInfo(checker=lambda *a, _r=r, **k: bool(_r.judge(*a, **k)))

    # -- configuration --------------------------------------------------------------------------

    @property
    def rules(self) -> tuple[ClaimRule, ...]:
        return tuple(self._rules.values())

    def set_lowering(self, symbol_id: Hashable, *, execution_transform: Callable, grad_transform: Callable | None):
        """Attach how a claimed symbol becomes tk kernel calls (done where the kernel's op is defined)."""
        self._rules[symbol_id] = dataclasses.replace(
            self._rules[symbol_id], execution_transform=execution_transform, grad_transform=grad_transform
        )

    @cached_property
    def private_fuser(self) -> FusionExecutor:
        """Thunder's torch.compile executor, minus the symbols that must stay outside fusion regions, compiling
        each distinct region once (`thunder_tk.fusion`)."""
        from thunder.executors.torch_compile import cuda_device_checker
        from thunder.executors.torchex import ex as pytorch_ex

        from thunder_tk.fusion import SharingTorchCompileExecutor

        fuser = SharingTorchCompileExecutor(name="tk_torchcompile")
        # Collectives inside a torch.compile region break (async work handles); GEMMs and attention are
        # ours or cuBLAS/cuDNN calls, and splitting regions at them keeps compile times short. CUDA tensors only:
        # on CPU (smoke runs, tests) compiling costs far more than it saves.
        excluded = COLLECTIVE_IDS | set(self._rules)
        fuser._implmap = {op: ImplInfo(checker=cuda_device_checker) for op in pytorch_ex.implmap if op not in excluded}
        return fuser

    def default_fuser(self) -> FusionExecutor:
        """nvFuser when Thunder can load it, else the private torch.compile fuser."""
        nvfuser = get_executor("nvfuser")
        return nvfuser if isinstance(nvfuser, FusionExecutor) else self.private_fuser

    def attention_fallbacks(self) -> tuple[Executor, ...]:
        found = (get_executor(name) for name in ATTENTION_FALLBACKS)
        return tuple(ex for ex in found if isinstance(ex, OperatorExecutor))

    # -- where tk sits ---------------------------------------------------------------------------

    def _active_executors(self) -> tuple[Executor, ...]:
        cd = get_compile_data()
        return tuple(cd.executors_list) if cd is not None else (self,)

    def _fuser_in_use(self) -> FusionExecutor | None:
        """The fuser tk delegates to, or None when the executor list names a general fuser itself."""
        for ex in self._active_executors():
            if ex is not self and is_general_fuser(ex):
                return None
        return self.default_fuser()

    def _fallbacks_in_use(self, rule: ClaimRule) -> tuple[Executor, ...]:
        if rule.family != "attention":
            return ()
        active = set(ex.name for ex in self._active_executors())
        return tuple(ex for ex in self.attention_fallbacks() if ex.name not in active)

    def _gradient_fallbacks(self, rule: ClaimRule) -> tuple[Executor, ...]:
        """Who may take forward and gradient of a symbol tk cannot differentiate: tk's own fallbacks (in the order
        the forward is delegated), then the executors listed after tk (Thunder would have asked them next)."""
        active = self._active_executors()
        later = active[active.index(self) + 1:] if self in active else ()
        return (*self._fallbacks_in_use(rule), *later)

    # -- judging ---------------------------------------------------------------------------------

    def _decide(self, rule: ClaimRule, args, kwargs, *, gradient: bool = False) -> _Route:
        """Where the symbol goes: to tk (verdict accepts) or to a fallback executor, or nowhere (None).

        With `gradient`, forward and gradient are judged together, as Thunder asks when it differentiates the
        symbol: tk keeps it only if it has the gradient too, and a fallback must have a grad transform."""
        verdict = rule.judge(*args, **kwargs)
        if verdict and rule.execution_transform is None:
            verdict = claim_rules.decline(f"tk has no lowering for {rule.name} yet")
        forward_accepted = bool(verdict)
        if verdict and gradient:
            verdict = rule.judge_gradient()
        if verdict:
            return _Route(rule, verdict, None)
        passed_over = []
        unmasked = claim_rules.sdpa_without_mask(args, kwargs) if rule.family == "attention" else None
        if unmasked is not None:
            args, kwargs, read = unmasked
        for ex in self._gradient_fallbacks(rule) if gradient else self._fallbacks_in_use(rule):
            impl = ex.implmap.get(rule.symbol_id)
            if impl is None or (gradient and impl.grad_transform is None):
                continue
            # Before the checker: a plan made without a GPU, where the fallbacks' checkers decline, says it too.
            limit = FALLBACK_SHAPE_LIMITS.get(ex.name)
            if limit is not None and (problem := limit(*args, **kwargs)) is not None:
                passed_over.append(f"{ex.name} not used: {problem}")
                continue
            if impl.checker is None or impl.checker(*args, **kwargs):
                if forward_accepted:
                    verdict = claim_rules.decline(f"{verdict.reason}; {ex.name} takes forward and backward")
                if unmasked is not None:
                    verdict = claim_rules.decline(f"{verdict.reason}; {ex.name} runs it with {read}")
                return _Route(rule, verdict, ex, mask_dropped=unmasked is not None)
        if forward_accepted:
            verdict = claim_rules.decline(f"{verdict.reason}; no executor takes its gradient, so Thunder "
                                          "differentiates its decomposition")
        if passed_over:
            verdict = claim_rules.decline("; ".join([verdict.reason, *passed_over]))
        return _Route(rule, verdict, None)

    def _route(self, bsym: BoundSymbol) -> _Route | None:
        rule = self._rules.get(bsym.sym.id)
        if rule is None:
            return None
        route = self._decide(rule, bsym.args, bsym.kwargs)
        self._last_site = _record(bsym, route)
        self._last_judged = bsym
        return route

    # -- the Executor interface ------------------------------------------------------------------

    def can_execute(self, bsym: BoundSymbol) -> bool:
        route = self._route(bsym)
        return route is not None and route.taken

    def can_fuse(self, bsym: BoundSymbol) -> bool:
        if bsym.sym.id in self._rules:
            return self.can_execute(bsym)
        if bsym.sym.executor is self or bsym.sym.id in COLLECTIVE_IDS:
            return False
        fuser = self._fuser_in_use()
        return fuser is not None and fuser.can_fuse(bsym)

    def get_execution_transform(self, bsym: BoundSymbol) -> Callable | None:
        route = self._route(bsym)
        if route is None or not route.taken:
            return None  # kept for the fusion pass
        if route.fallback is None:
            return self._tagging(route.rule.execution_transform, self._last_site)
        impl = route.fallback.implmap[bsym.sym.id]
        if route.mask_dropped:  # judged (by _decide) on the arguments without the mask, as it will be called
            return _unmasking(impl.execution_transform or impl.symbol)
        transform = route.fallback.get_execution_transform(bsym)
        return transform if transform is not None else impl.symbol

    def _tagging(self, transform: Callable, site) -> Callable:
        """`transform`, tagging what tk's own ops in it compute with the symbol's site, so that `explain` names the
        kernel op even where a cheap op of another executor makes the symbol's result (the cross-entropy's
        reduction of its per-row losses)."""
        if site is None:
            return transform

        def tagged(*args, **kwargs):
            ctx = get_tracectx()
            scope = ctx.peek_scope() if ctx is not None else None
            first = len(scope) if scope is not None else 0
            result = transform(*args, **kwargs)
            for b in scope[first:] if scope is not None else ():
                if b.sym.executor is self:
                    for p in b.flat_proxy_outs:
                        p.tags.add(site)
            return result

        return tagged

    def get_grad_transform(self, sym: Symbol) -> Callable | None:
        """How Thunder differentiates a symbol tk said it takes: tk's own grad transform, the grad transform of
        the executor that takes forward and gradient instead (tk ran only the forward, e.g. no backward kernel in
        this build), or None (Thunder then differentiates the symbol's decomposition)."""
        rule = self._rules.get(sym.id)
        if rule is None or (rule.grad_transform is None and rule.family != "attention"):
            return None  # e.g. GEMMs: Thunder's own gradient, whose GEMMs tk claims in turn

        # Thunder asks for the grad transform by symbol right after `can_execute_or_fuse(bsym)` said yes for
        # the bound symbol just judged: judge it again, forward and gradient together, and record that.
        bsym, site, decided = self._last_judged, self._last_site, None
        if bsym is not None and bsym.sym.id == sym.id:
            decided = self._decide(rule, bsym.args, bsym.kwargs, gradient=True)
            site = _record(bsym, decided)
            if not decided.taken:
                return None

        def grad_transform(*args, **kwargs):
            route = decided if decided is not None else self._decide(rule, args, kwargs, gradient=True)
            if route.fallback is not None:
                transform, runner = route.fallback.get_grad_transform(sym), route.fallback
                if route.mask_dropped:
                    transform = _unmasking(transform)
            elif route.verdict:
                transform, runner = rule.grad_transform, self
            else:
                raise AssertionError(f"tk was asked for the gradient of a {rule.name} that no executor takes "
                                     f"({route.verdict.reason})")
            scope = get_tracectx().peek_scope()
            first = len(scope)
            result = transform(*args, **kwargs)
            # Tag what the runner's own ops compute, so `explain` can name the ops of the backward too.
            if site is not None:
                for b in scope[first:]:
                    if b.sym.executor is runner:
                        for p in b.flat_proxy_outs:
                            p.tags.add(site)
            return result

        # The route depends on the build and the executor list, so Thunder must not reuse a split made earlier.
        grad_transform._disable_caching = True
        return grad_transform

    def fusion_pass(self, trace):
        from thunder_tk.pattern_fusion import (attend_grouped_kv, attention_backward_into_qkv, fold_row_scaling,
                                               fuse_swiglu, fuse_swiglu_grad, merge_repeated_casts,
                                               rope_into_qkv_projection, sum_products, widen_products,
                                               write_gradient_over_logits)

        from thunder_tk.attention_masks import drop_unread_constants
        from thunder_tk.fsdp_schedule import overlap_collectives
        from thunder_tk.rms_norm_fusion import fold_rms_norm

        trace = drop_unread_constants(trace)  # first: the masks of attention that tk runs without them
        trace = attend_grouped_kv(write_gradient_over_logits(fold_row_scaling(merge_repeated_casts(trace))))
        trace = rope_into_qkv_projection(attention_backward_into_qkv(trace))
        trace = sum_products(fuse_swiglu_grad(fuse_swiglu(trace)))
        trace = fold_rms_norm(trace)  # after sum_products: the norm's incoming gradient is then the summed launch's
        trace = widen_products(trace)  # after fold_rms_norm, which reads a 16-bit incoming gradient
        fuser = self._fuser_in_use()
        if fuser is None:  # the list's own fuser runs after this pass (tk's fuser then schedules, see fusion.py)
            return trace
        # After the fuser, whose regrouping undoes Thunder's sorting of the waits.
        return overlap_collectives(fuser.fusion_pass(trace))

    def get_fuel(self, amount: int = 1, /) -> bool:
        return self.default_fuser().get_fuel(amount)

    def set_fuel(self, value):
        return self.default_fuser().set_fuel(value)


# ------------------------------------------------------------------------------------------------
# Decision log, kept on the compile data of the jitted function that is being compiled.
#
# Each judged symbol is a "site". Its output proxies carry a `Site` tag; Thunder copies proxy tags when it
# renames or replaces proxies, so `explain` finds the site's result in the final traces whatever ran it.

DECISIONS_ATTR = "_thunder_tk_decisions"
_site_numbers = itertools.count()


@dataclass(frozen=True)
class Site:
    number: int


def sites_of(proxy) -> list[Site]:
    return [t for t in getattr(proxy, "tags", ()) if isinstance(t, Site)]


def describe_inputs(args, kwargs, check: Callable | None = None) -> str:
    """Tensor shapes, then the scalar arguments that differ from their defaults in the rule's checker's signature
    (attention's is_causal and scale, which Thunder may pass positionally)."""
    parts = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, TensorProxy):
            parts.append(f"{a.dtype.shortname()}{list(a.shape)}")
    try:
        bound = inspect.signature(check).bind(*args, **kwargs) if check is not None else None
    except TypeError:
        bound = None
    if bound is None:
        parts += [f"{k}={v}" for k, v in kwargs.items() if not isinstance(v, TensorProxy) and v is not None]
        return ", ".join(parts)
    for name, param in inspect.signature(check).parameters.items():
        if name not in bound.arguments or param.default is inspect.Parameter.empty:
            continue
        value = bound.arguments[name]
        if isinstance(value, TensorProxy) or value is None:
            continue
        try:
            value = pyval(value)
        except Exception:  # a proxy without a known value: show it as traced
            pass
        if value != param.default:
            parts.append(f"{name}={value}")
    return ", ".join(parts)


def _record(bsym: BoundSymbol, route: _Route) -> Site | None:
    cd = get_compile_data()
    if cd is None:
        return None
    # One log per compilation (keyed by when its tracing started), so a recompile does not mix in old sites.
    _, cs = _compile_data.get()
    stamp = getattr(cs, "last_trace_tracing_start", None)
    logs: dict = cd.__dict__.setdefault(DECISIONS_ATTR, {})
    log = logs.setdefault(stamp, {})

    # A symbol judged again under another name (ltorch.linear, then its prims.linear) is the same site;
    # a symbol of another family computing the same result (the last matmul of a decomposed attention)
    # is a site of its own.
    outputs = bsym.flat_proxy_outs
    known = [s for p in outputs for s in sites_of(p) if s in log]
    site = next((s for s in known if log[s].family == route.rule.family), None)
    if site is None:
        site = Site(next(_site_numbers))
        for p in outputs:
            p.tags.add(site)
    claimed_by = "tk" if route.verdict else (route.fallback.name if route.fallback is not None else None)
    decision = Decision(
        symbol=route.rule.name,
        family=route.rule.family,
        inputs=describe_inputs(bsym.args, bsym.kwargs, route.rule.check),
        site=site,
        claimed_by=claimed_by,
        reason="" if route.verdict else route.verdict.reason,
    )
    log.pop(site, None)  # the latest judgement of a site wins (grad pass, then operator pass)
    log[site] = decision
    return site


def decisions_of(cd) -> list[Decision]:
    """Every recorded decision, oldest compilation first."""
    return [d for log in getattr(cd, DECISIONS_ATTR, {}).values() for d in log.values()]


def latest_decisions_of(cd) -> list[Decision]:
    logs = getattr(cd, DECISIONS_ATTR, {})
    return list(logs[next(reversed(logs))].values()) if logs else []


tk = TKExecutor(claim_rules.RULES)
register_executor(tk)
# By name too, so string lists such as ["tk", "tk_torchcompile"] resolve.
register_executor(tk.private_fuser)

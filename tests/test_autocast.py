"""te.autocast and the state readers: nesting, enabled=False regions, exceptions at every depth,
per-thread and per-asyncio-task isolation, re-entry, refusal of a recipe the device cannot run
(state untouched), the first-module flag, argument checks, and no reference or memory growth.
"""
import asyncio
import contextvars
import gc
import sys
import threading
import tracemalloc
import warnings

import pytest

import tequant as te
from tequant import _C
from tequant.recipe import (CustomRecipe, DelayedScaling, Float8BlockScaling,
                            Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling)


def state():
    return (te.is_fp8_enabled(), te.is_fp8_calibration(), te.get_fp8_recipe(),
            te.get_fp8_group(), te.autocast_depth())


OUTSIDE = (False, False, Float8CurrentScaling(), None, 0)


@pytest.fixture
def simulated_devices():
    """Pretend this machine has GPUs of given capabilities; always restore the real facts."""
    yield _C._set_device_facts
    _C._set_device_facts(None)


def test_outside_any_autocast():
    assert state() == OUTSIDE
    assert te.is_first_fp8_module() is False


def test_recipe_none_means_current_scaling():
    with te.autocast() as ac:
        assert ac.recipe == Float8CurrentScaling()
        assert te.get_fp8_recipe() == Float8CurrentScaling()
        assert te.is_fp8_enabled()


def test_enter_returns_self_and_attributes():
    group = object()
    r = MXFP8BlockScaling()
    ac = te.autocast(True, True, r, group)
    assert (ac.enabled, ac.calibrating, ac.recipe, ac.amax_reduction_group) == (True, True, r, group)
    assert not ac.active
    with ac as entered:
        assert entered is ac and ac.active
        assert te.get_fp8_group() is group
        assert te.is_fp8_calibration()
    assert not ac.active
    assert "MXFP8BlockScaling" in repr(ac)


def test_nesting_three_deep_with_different_recipes():
    r1, r2, r3 = DelayedScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()
    g1, g3 = object(), object()
    with te.autocast(recipe=r1, amax_reduction_group=g1):
        assert state() == (True, False, r1, g1, 1)
        with te.autocast(recipe=r2, calibrating=True):
            assert state() == (True, True, r2, None, 2)
            with te.autocast(recipe=r3, amax_reduction_group=g3):
                assert state() == (True, False, r3, g3, 3)
            assert state() == (True, True, r2, None, 2)
        assert state() == (True, False, r1, g1, 1)
    assert state() == OUTSIDE


def test_enabled_false_inside_enabled():
    r = Float8BlockScaling()
    with te.autocast(recipe=r):
        with te.autocast(enabled=False):
            assert not te.is_fp8_enabled()
            assert te.autocast_depth() == 2
            assert te.get_fp8_recipe() == Float8CurrentScaling()  # the inner block's recipe
            with te.autocast(recipe=r):
                assert te.is_fp8_enabled()
            assert not te.is_fp8_enabled()
        assert te.is_fp8_enabled() and te.get_fp8_recipe() is r


RECIPES3 = [DelayedScaling(), MXFP8BlockScaling(), NVFP4BlockScaling()]
# INSIDE[k]: the state with k autocasts active (the second one has enabled=False).
INSIDE = [OUTSIDE] + [(d != 1, False, RECIPES3[d], None, d + 1) for d in range(3)]


@pytest.mark.parametrize("raise_depth, catch_depth",
                         [(r, c) for r in (1, 2, 3) for c in range(r)])
def test_exception_at_each_depth_restores_state(raise_depth, catch_depth):
    def nest(depth):  # `depth` autocasts are active here
        assert state() == INSIDE[depth]
        if depth == raise_depth:
            raise KeyError(depth)
        with te.autocast(recipe=RECIPES3[depth], enabled=depth != 1):
            if depth + 1 == catch_depth:
                with pytest.raises(KeyError):
                    nest(depth + 1)
                assert state() == INSIDE[depth + 1]
            else:
                nest(depth + 1)

    if catch_depth == 0:
        with pytest.raises(KeyError):
            nest(0)
    else:
        nest(0)
    assert state() == OUTSIDE


def test_reentry_of_active_instance_raises_and_keeps_state():
    ac = te.autocast(recipe=MXFP8BlockScaling())
    with ac:
        before = state()
        with pytest.raises(RuntimeError, match="cannot be entered more than once"):
            ac.__enter__()
        assert state() == before and ac.active
    assert state() == OUTSIDE


def test_sequential_reuse_and_exit_without_enter():
    ac = te.autocast(recipe=NVFP4BlockScaling())
    for _ in range(3):
        with ac:
            assert te.autocast_depth() == 1
    with pytest.raises(RuntimeError, match="not active"):
        ac.__exit__(None, None, None)
    assert state() == OUTSIDE


def test_two_threads_with_different_recipes_do_not_see_each_other():
    barrier = threading.Barrier(2, timeout=10)
    results, errors = {}, []

    def worker(name, recipe):
        try:
            assert state() == OUTSIDE  # a new thread starts outside any autocast
            with te.autocast(recipe=recipe):
                barrier.wait()  # both threads are inside their own autocast now
                for _ in range(1000):
                    assert te.get_fp8_recipe() is recipe and te.autocast_depth() == 1
                barrier.wait()
            results[name] = state()
        except Exception as exc:  # surfaced below
            errors.append(exc)

    r1, r2 = MXFP8BlockScaling(), DelayedScaling()
    with te.autocast(recipe=NVFP4BlockScaling()):
        threads = [threading.Thread(target=worker, args=("a", r1)),
                   threading.Thread(target=worker, args=("b", r2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert te.get_fp8_recipe() == NVFP4BlockScaling()
    assert not errors, errors
    assert results == {"a": OUTSIDE, "b": OUTSIDE}


def test_two_asyncio_tasks_with_different_recipes_do_not_see_each_other():
    async def task(recipe, started, other_started):
        with te.autocast(recipe=recipe):
            started.set()
            await other_started.wait()  # the other task is inside its own autocast now
            for _ in range(3):
                await asyncio.sleep(0)
                assert te.get_fp8_recipe() is recipe and te.autocast_depth() == 1
        return state()

    async def main():
        e1, e2 = asyncio.Event(), asyncio.Event()
        r1, r2 = MXFP8BlockScaling(), Float8BlockScaling()
        return await asyncio.gather(task(r1, e1, e2), task(r2, e2, e1))

    assert asyncio.run(main()) == [OUTSIDE, OUTSIDE]


def test_child_task_keeps_the_state_it_was_created_in():
    async def child(release):
        await release.wait()  # the parent has left its autocast by now
        return state()

    async def main():
        release = asyncio.Event()
        r = MXFP8BlockScaling()
        with te.autocast(recipe=r):
            t = asyncio.ensure_future(child(release))
        release.set()
        return await t, r

    inner, r = asyncio.run(main())
    assert inner == (True, False, r, None, 1)


def test_copy_context_sees_state_and_changes_stay_inside():
    r = MXFP8BlockScaling()
    with te.autocast(recipe=r):
        ctx = contextvars.copy_context()

    def run():
        assert te.get_fp8_recipe() is r
        with te.autocast(recipe=DelayedScaling()):
            assert te.autocast_depth() == 2
        return te.autocast_depth()

    assert ctx.run(run) == 1
    assert state() == OUTSIDE


def test_exit_in_another_context_raises():
    ac = te.autocast(recipe=MXFP8BlockScaling())
    ctx = contextvars.copy_context()
    ctx.run(ac.__enter__)
    with pytest.raises(ValueError):
        ac.__exit__(None, None, None)  # entered inside ctx, exited outside it
    assert state() == OUTSIDE


def test_first_module_flag():
    assert te.is_first_fp8_module() is False
    with te.autocast():
        assert te.is_first_fp8_module() is True
        assert te.is_first_fp8_module() is False
    with te.autocast():
        with te.autocast(recipe=MXFP8BlockScaling()):
            assert te.is_first_fp8_module() is True  # the outermost's flag, seen from inside
        # an inner exit does not make a second module "first" (TE's snapshot restore would)
        assert te.is_first_fp8_module() is False
    with te.autocast(enabled=False):
        assert te.is_first_fp8_module() is True


@pytest.mark.parametrize("caps, recipe, reason", [
    ([(8, 0)], Float8CurrentScaling(), "compute capability 8.0"),
    ([(8, 9)], DelayedScaling(), "need 9.0"),
    ([(10, 0)], Float8BlockScaling(), "Hopper-only"),
    ([(7, 5)], MXFP8BlockScaling(), "need 9.0"),
])
def test_unsupported_recipe_raises_at_enter_and_leaves_state_untouched(simulated_devices, caps,
                                                                       recipe, reason):
    simulated_devices(caps)
    outer = MXFP8BlockScaling() if caps[0] >= (9, 0) else None
    if outer is not None:
        with te.autocast(recipe=outer):
            before = state()
            ac = te.autocast(recipe=recipe)
            with pytest.raises(RuntimeError, match=reason):
                ac.__enter__()
            assert state() == before and not ac.active
            assert te.is_first_fp8_module() is True  # not consumed or reset by the failed enter
    ac = te.autocast(recipe=recipe)
    with pytest.raises(RuntimeError, match=reason):
        with ac:
            pytest.fail("the block must not run")
    assert state() == OUTSIDE and not ac.active
    # enabled=False never checks the device: it runs in high precision.
    with te.autocast(enabled=False, recipe=recipe):
        assert te.autocast_depth() == 1


def test_block_scaling_needs_cublaslt_12_9(simulated_devices):
    simulated_devices([(9, 0)], cublaslt_version=120800)
    with pytest.raises(RuntimeError, match="cuBLASLt 12.9"):
        with te.autocast(recipe=Float8BlockScaling()):
            pass
    with te.autocast(recipe=Float8CurrentScaling()):
        assert te.is_fp8_enabled()


def test_mixed_devices_check_the_current_one(simulated_devices):
    simulated_devices([(9, 0), (8, 0)])  # current device is 0 under the hook
    for _ in range(2):  # the second round goes through the per-device path, not a cached verdict
        with te.autocast(recipe=DelayedScaling()):
            assert te.is_fp8_enabled()


def test_fp8_autocast_is_a_deprecated_alias():
    r, g = MXFP8BlockScaling(), object()
    with pytest.warns(DeprecationWarning, match="fp8_autocast is deprecated"):
        ac = te.fp8_autocast(enabled=True, calibrating=True, fp8_recipe=r, fp8_group=g)
    with ac:
        assert state() == (True, True, r, g, 1)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(enabled="yes"), TypeError, "enabled must be a bool, got str"),
    (dict(calibrating=1), TypeError, "calibrating must be a bool, got int"),
    (dict(recipe="MXFP8"), TypeError, "recipe must be a tequant.recipe.Recipe"),
    (dict(recipe=[1]), TypeError, "recipe must be a tequant.recipe.Recipe"),
    (dict(recip=None), TypeError, "unexpected keyword argument 'recip'"),
])
def test_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        te.autocast(**kwargs)
    assert state() == OUTSIDE


def test_positional_and_duplicate_arguments():
    with pytest.raises(TypeError, match="at most 4"):
        te.autocast(True, False, None, None, None)
    with pytest.raises(TypeError, match="multiple values for argument 'enabled'"):
        te.autocast(True, enabled=False)
    ac = te.autocast(False, True, DelayedScaling(), None)
    assert (ac.enabled, ac.calibrating, ac.recipe) == (False, True, DelayedScaling())


def test_construction_through_tp_call_matches_vectorcall():
    r = NVFP4BlockScaling()
    ac = type.__call__(te.Autocast, enabled=False, recipe=r)  # tp_call -> tp_new, not vectorcall
    assert (ac.enabled, ac.recipe) == (False, r)
    with pytest.raises(TypeError, match="calibrating must be a bool"):
        type.__call__(te.Autocast, calibrating=None)


def test_autocast_is_final_and_immutable():
    with pytest.raises(TypeError):
        class Sub(te.Autocast):  # noqa: F841
            pass
    with pytest.raises(TypeError):
        te.Autocast.extra = 1
    ac = te.autocast()
    with pytest.raises(AttributeError):
        ac.enabled = False
    with pytest.raises(AttributeError):
        ac.recipe = DelayedScaling()


def test_custom_recipe_enters():
    r = CustomRecipe(qfactory=lambda role: None)
    with te.autocast(recipe=r):
        assert te.get_fp8_recipe() is r


def _cycles(n, ac_type, recipe):
    for _ in range(n):
        with ac_type(recipe=recipe):
            pass


def test_no_reference_or_memory_growth_over_a_million_cycles():
    r = MXFP8BlockScaling()
    group = object()
    _cycles(1000, te.autocast, r)  # warm the recipe table and caches
    gc.collect()
    refs = (sys.getrefcount(r), sys.getrefcount(group), sys.getrefcount(te.autocast))
    objects = len(gc.get_objects())
    table = _C._recipe_table_size()
    for _ in range(1_000_000):
        with te.autocast(recipe=r, amax_reduction_group=group):
            pass
    gc.collect()
    assert (sys.getrefcount(r), sys.getrefcount(group), sys.getrefcount(te.autocast)) == refs
    assert len(gc.get_objects()) <= objects + 10
    assert _C._recipe_table_size() == table
    # Bytes held by Python's allocators (objects, contextvars HAMT nodes, tokens) do not grow.
    tracemalloc.start()
    try:
        _cycles(1000, te.autocast, r)
        before = tracemalloc.get_traced_memory()[0]
        _cycles(100_000, te.autocast, r)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 4096, (before, after)


def test_inline_recipe_construction_does_not_grow_tables():
    with te.autocast(recipe=MXFP8BlockScaling()):
        pass
    table = _C._recipe_table_size()
    for _ in range(1000):
        with te.autocast(recipe=MXFP8BlockScaling()):
            assert te.is_fp8_enabled()
    assert _C._recipe_table_size() == table


def test_warnings_are_not_emitted_on_the_normal_path():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=DelayedScaling()):
            pass

/* fused_ops.c: the kernels of torch.compile's tequant:: ops of the norm and the activation
 * (python/tequant/_norm_fn.py and _act_fn.py define the ops). Registered as the ops'
 * implementations, as linear_ops.c's are: the dispatcher calls these C functions with no
 * Python frame in between (a Python body around the same C calls cost ~2-10 us a call:
 * docs/results/NOTES.md, forty-first session). given_ops.c has te.Linear's on given operands.
 *
 *   norm_fwd_op(x, gamma, beta, normalization, eps, zero_centered, want_hp, want_stats,
 *               recipe_id, scale, padded, columnwise) -> _C._norm_fwd's list
 *   norm_fwd_delayed_op(..., recipe_id, scale_fwd, padded, columnwise, hist_fwd)
 *       -> (y_hp, mean, rstd, codes, scale_inv, codes_t), x's amax into hist_fwd's row 0
 *   norm_bwd_op(dy, x, gamma, mean, rstd, normalization, zero_centered, want_dbeta, grad_dtype)
 *   act_fwd_op(h, activation, want_hp, recipe_id, scale, padded[, columnwise]) -> list
 *   act_fwd_delayed_op(h, activation, want_hp, recipe_id, scale_fwd, padded, columnwise,
 *                      hist_fwd) -> (y_hp, codes, scale_inv, codes_t)
 *   act_bwd_op(dy, h, activation, recipe_id, padded, scale, dbias_dtype[, columnwise]) -> list
 *   act_bwd_over_h_op(dy, h, activation) -> None (dh written over h)
 *   act_bwd_over_dy_op(dy, h, activation) -> None (dh written over dy; not gated)
 * A recipe id resolves to its linear plan entry (linear_ops.c): the forward codes use its
 * "input" config, the activation's backward its "grad_output" one. A fixed tuple holds an empty
 * uint8 [0] tensor for each absent output. Allocations run as in any compiled op (tqx_in_op: a
 * CUDA-graph pool may hold the outputs).
 * Tests: tests/test_fused_ops_c.py, and the compiled-vs-eager bits of
 * tests/test_fused_norm_compile.py, tests/test_fused_act_modules.py, tests/test_fused_dh.py.
 */
#include <string.h>

#include "module.h"

/* *config: the recipe's config at `index` of its plan, borrowed from *entry (a new reference),
 * or None with *entry NULL for a recipe_id of None. -1 with an exception. */
static int config_of(tqx_state *st, PyObject *recipe_id, Py_ssize_t index, PyObject **entry,
                     PyObject **config) {
    *entry = NULL;
    *config = Py_None;
    if (recipe_id == Py_None) return 0;
    if ((*entry = tqx_linear_entry(st, recipe_id)) == NULL) return -1;
    *config = PyTuple_GET_ITEM(PyTuple_GET_ITEM(*entry, 0), index);
    return 0;
}

/* fn(call) as a compiled op, call[at] set to recipe_id's config `index` (new reference, or NULL
 * with an exception). */
static PyObject *with_config(tqx_fastcall fn, PyObject *module, PyObject *recipe_id,
                             Py_ssize_t index, PyObject **call, Py_ssize_t at, Py_ssize_t n) {
    PyObject *entry;
    if (config_of(tqx_module_state(module), recipe_id, index, &entry, &call[at]) < 0) return NULL;
    PyObject *outs = tqx_in_op(fn, module, call, n);
    Py_XDECREF(entry);
    return outs;
}

/* The fixed tuple of n outputs: the next of `outs` (a list; `skip`, an amax slot the caller
 * owns, passed over) where wanted[i], else an absent tensor on like's device. */
static PyObject *fixed_tuple(tqx_state *st, PyObject *outs, PyObject *skip, const int *wanted,
                             int n, PyObject *like) {
    PyObject *tuple = PyTuple_New(n);
    Py_ssize_t next = 0;
    for (int i = 0; tuple && i < n; i++) {
        while (next < PyList_GET_SIZE(outs) && PyList_GET_ITEM(outs, next) == skip) next++;
        PyObject *v = NULL;
        if (!wanted[i])
            v = tqx_absent(st, like);
        else if (next < PyList_GET_SIZE(outs))
            v = Py_NewRef(PyList_GET_ITEM(outs, next++));
        else
            PyErr_SetString(PyExc_RuntimeError, "fused op: fewer outputs than its tuple wants");
        if (v == NULL) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, i, v);
    }
    return tuple;
}

/* fn(call) under DelayedScaling on a te.Linear's forward buffers: call[at] the recipe's input
 * config, call[at + 1] and call[at + 2] x's scale and amax slot (views of scale_fwd and
 * hist_fwd: the kernel max-accumulates amax(y) into the slot); fn's outputs as the fixed tuple
 * of n_wanted (the slot passed over). name: the op, for messages. */
static PyObject *delayed_fixed(tqx_fastcall fn, PyObject *module, const char *name,
                               PyObject *recipe_id, PyObject *hist, PyObject *scale,
                               PyObject **call, Py_ssize_t n, Py_ssize_t at, const int *wanted,
                               int n_wanted) {
    tqx_state *st = tqx_module_state(module);
    PyObject *entry, *outs = NULL, *result = NULL;
    tqx_delayed_buffers c = TQX_DELAYED_BUFFERS_INIT;
    if (config_of(st, recipe_id, TQX_PLAN_INPUT, &entry, &call[at]) < 0) return NULL;
    if (entry == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: recipe_id must name a recipe", name);
        return NULL;
    }
    if (tqx_op_module_states(st, entry, TQX_DELAYED_FORWARD, hist, scale, call[0], &c) == 0) {
        PyObject *slot = PyTuple_GET_ITEM(c.states[0], 1);
        call[at + 1] = PyTuple_GET_ITEM(c.states[0], 0);
        call[at + 2] = slot;
        if ((outs = tqx_in_op(fn, module, call, n)) != NULL)
            result = fixed_tuple(st, outs, slot, wanted, n_wanted, call[0]);
    }
    Py_XDECREF(outs);
    Py_DECREF(entry);
    tqx_delayed_buffers_clear(&c);
    return result;
}

/* ---- the norm ---- */

static PyObject *norm_fwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("norm_fwd_op", nargs, 12, 12) < 0) return NULL;
    PyObject *call[13] = {args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                          args[7], NULL, args[9], Py_None, args[10], args[11]};
    return with_config(tqx_norm_fwd, module, args[8], TQX_PLAN_INPUT, call, 8, 13);
}

static PyObject *norm_fwd_delayed_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    int want_hp, want_stats, columnwise;
    const char *norm = nargs == 13 ? PyUnicode_AsUTF8(args[3]) : "";
    if (tqx_op_arity("norm_fwd_delayed_op", nargs, 13, 13) < 0 || norm == NULL
        || tqx_flag_arg(args[6], &want_hp) < 0 || tqx_flag_arg(args[7], &want_stats) < 0
        || tqx_flag_arg(args[11], &columnwise) < 0)
        return NULL;
    const int layer_norm = strcmp(norm, "LayerNorm") == 0;
    const int wanted[6] = {want_hp, want_stats && layer_norm, want_stats, 1, 1, columnwise};
    PyObject *call[13] = {args[0], args[1], args[2], args[3], args[4], args[5], args[6],
                          args[7], NULL, NULL, NULL, args[10], args[11]};
    return delayed_fixed(tqx_norm_fwd, module, "norm_fwd_delayed", args[8], args[12], args[9],
                         call, 13, 8, wanted, 6);
}

static PyObject *norm_bwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return tqx_op_arity("norm_bwd_op", nargs, 9, 9) < 0 ? NULL : tqx_in_op(tqx_norm_bwd, module, args, 9);
}

/* ---- the activation ---- */

static PyObject *act_fwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("act_fwd_op", nargs, 6, 7) < 0) return NULL;
    PyObject *call[8] = {args[0], args[1], args[2], NULL, args[4], Py_None, args[5],
                         nargs == 7 ? args[6] : Py_False};
    return with_config(tqx_act_fwd, module, args[3], TQX_PLAN_INPUT, call, 3, 8);
}

static PyObject *act_fwd_delayed_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    int want_hp, columnwise;
    if (tqx_op_arity("act_fwd_delayed_op", nargs, 8, 8) < 0 || tqx_flag_arg(args[2], &want_hp) < 0
        || tqx_flag_arg(args[6], &columnwise) < 0)
        return NULL;
    const int wanted[4] = {want_hp, 1, 1, columnwise};
    PyObject *call[8] = {args[0], args[1], args[2], NULL, NULL, NULL, args[5], args[6]};
    return delayed_fixed(tqx_act_fwd, module, "act_fwd_delayed", args[3], args[7], args[4], call,
                         8, 3, wanted, 4);
}

static PyObject *act_bwd_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (tqx_op_arity("act_bwd_op", nargs, 7, 8) < 0) return NULL;
    PyObject *call[9] = {args[0], args[1], args[2], NULL, args[5], Py_None, args[4], args[6],
                         nargs == 8 ? args[7] : Py_False};
    return with_config(tqx_act_bwd, module, args[3], TQX_PLAN_GRAD_OUTPUT, call, 3, 9);
}

/* dh written over args[over] (h, or dy where dh has dy's shape): the kernels read each element
 * of dy and h before they write it, one thread an element */
static PyObject *act_bwd_over(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                              const char *name, int over) {
    if (tqx_op_arity(name, nargs, 3, 3) < 0) return NULL;
    PyObject *call = PyTuple_Pack(3, args[0], args[1], args[2]);
    PyObject *kwargs = call ? Py_BuildValue("{sO}", "dh", args[over]) : NULL;
    PyObject *result = kwargs ? tqx_act_backward(module, call, kwargs) : NULL;
    Py_XDECREF(call);
    Py_XDECREF(kwargs);
    return result;
}

static PyObject *act_bwd_over_h_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return act_bwd_over(module, args, nargs, "act_bwd_over_h_op", 1);
}

static PyObject *act_bwd_over_dy_op(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return act_bwd_over(module, args, nargs, "act_bwd_over_dy_op", 0);
}

#define OP(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}
PyMethodDef tqx_fused_ops_methods[] = {
    OP(norm_fwd_op, "The kernel of tequant::norm_fwd (csrc/ext/fused_ops.c)."),
    OP(norm_fwd_delayed_op, "The kernel of tequant::norm_fwd_delayed: x's amax into hist_fwd."),
    OP(norm_bwd_op, "The kernel of tequant::norm_bwd."),
    OP(act_fwd_op, "The kernel of tequant::act_fwd."),
    OP(act_fwd_delayed_op, "The kernel of tequant::act_fwd_delayed: y's amax into hist_fwd."),
    OP(act_bwd_op, "The kernel of tequant::act_bwd."),
    OP(act_bwd_over_h_op, "The kernel of tequant::act_bwd_over_h: dh written over h."),
    OP(act_bwd_over_dy_op, "The kernel of tequant::act_bwd_over_dy: dh written over dy."),
    {NULL, NULL, 0, NULL}};

/* amax_update.c: the extension's call into tq_amax_update, delayed scaling's amax-history roll
 * and scale update (tequant.h "Delayed scaling").
 *
 * _amax_update(slots, history_len, algo, reduced): slots is a list/tuple of (history, scale,
 * scaled_max) with history a float32 [L, 1] view (e.g. hist[:, j:j+1] of an [L, n] buffer: row
 * stride n), scale a float32 tensor of one element, scaled_max a float; algo "max" or
 * "most_recent"; reduced None or a contiguous float32 tensor of len(slots) all-reduced amaxes.
 * Everything on one device; runs on that device's current stream with the GIL released.
 * tqx_amax_update_buffers (module.h): the same fused update of whole [L, c] histories and [c]
 * scales, for the compiled te.Linear's backward op (linear_ops.c), which runs it on a module's
 * buffers, and as _amax_update_buffers for tequant::amax_update (_compile_ops.py), which runs it
 * on a batch of modules' buffers in one call; tqx_amax_update_one, one column's slot for the
 * grad_output cast of that backward op to run after itself (tq_quantize_args.update), and
 * tqx_amax_update_run, that slot's update run alone where no cast ran it.
 * Tests: tests/test_amax_update.py, tests/test_compile.py, tests/test_compile_delayed.py.
 */
#include <stdio.h>

#include "module.h"


/* -1 with ValueError when t (named name) is not on `device` (where `first` lives). */
static int same_device(const tq_tensor *t, const char *name, int device, const char *first) {
    if (t->device == device) return 0;
    char got[32], want[32];
    tqx_device_name(t->device, got, sizeof got);
    tqx_device_name(device, want, sizeof want);
    PyErr_Format(PyExc_ValueError, "%s is on %s but %s is on %s: every history, scale and reduced "
                 "amax of one update must be on one device", name, got, first, want);
    return -1;
}

int tqx_amax_algo_from_py(PyObject *obj, tq_amax_algo *out) {
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_CompareWithASCIIString(obj, "max") == 0) return *out = TQ_AMAX_ALGO_MAX, 0;
        if (PyUnicode_CompareWithASCIIString(obj, "most_recent") == 0)
            return *out = TQ_AMAX_ALGO_MOST_RECENT, 0;
        PyErr_Format(PyExc_ValueError, "algo must be 'max' or 'most_recent', got %R", obj);
        return -1;
    }
    if (PyCallable_Check(obj)) return *out = TQ_AMAX_ALGO_CUSTOM, 0; /* the core refuses it */
    PyErr_Format(PyExc_TypeError, "algo must be 'max' or 'most_recent', got %s",
                 Py_TYPE(obj)->tp_name);
    return -1;
}

/* slot j's (history, scale, scaled_max) -> *slot; its device to *device (checked against the
 * first slot's). *stream gets slot 0's current stream. */
static int slot_from_py(tqx_state *st, PyObject *item, Py_ssize_t j, int64_t history_len,
                        int *device, void **stream, tq_amax_slot *slot) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
        PyErr_Format(PyExc_TypeError, "slots[%zd] must be a (history, scale, scaled_max) tuple, "
                     "got %s", j, Py_TYPE(item)->tp_name);
        return -1;
    }
    char name[64];
    tq_tensor h, s;
    tqx_tensor_info info;
    snprintf(name, sizeof name, "slots[%zd].history", j);
    if (tqx_tensor_from_py(st, PyTuple_GET_ITEM(item, 0), name, 1u << TQ_DTYPE_FLOAT32, &h,
                           j == 0 ? &info : NULL) < 0)
        return -1;
    if (h.cols != 1 || h.rows != history_len) {
        PyErr_Format(PyExc_ValueError, "%s is viewed as [%lld, %lld]; expected [history_len, 1] = "
                     "[%lld, 1] (a column such as hist[:, j:j+1])", name, (long long)h.rows,
                     (long long)h.cols, (long long)history_len);
        return -1;
    }
    if (j == 0) {
        *device = h.device;
        *stream = info.stream;
    } else if (same_device(&h, name, *device, "slots[0].history") < 0) {
        return -1;
    }
    snprintf(name, sizeof name, "slots[%zd].scale", j);
    if (tqx_tensor_from_py(st, PyTuple_GET_ITEM(item, 1), name, 1u << TQ_DTYPE_FLOAT32, &s,
                           NULL) < 0)
        return -1;
    if (s.rows * s.cols != 1) {
        PyErr_Format(PyExc_ValueError, "%s has %lld elements; expected one", name,
                     (long long)(s.rows * s.cols));
        return -1;
    }
    if (same_device(&s, name, *device, "slots[0].history") < 0) return -1;
    const double scaled_max = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 2));
    if (scaled_max == -1.0 && PyErr_Occurred()) return -1;
    slot->history = (float *)h.data;
    slot->stride = h.rows > 1 ? h.ld : 1;
    slot->scale = (float *)s.data;
    slot->scaled_max = (float)scaled_max; /* RN to float, as TE computes it on the host */
    return 0;
}

/* tq_amax_update over n slots on `device` / `stream`, with the GIL released; -1 with an
 * exception. */
static int run(tqx_state *st, const tq_amax_slot *slots, int64_t n, tq_amax_update_args *uargs,
               int device, void *stream) {
    tq_status s;
    uargs->device = device;
    Py_BEGIN_ALLOW_THREADS
    s = tq_amax_update(slots, n, uargs, (struct CUstream_st *)stream);
    Py_END_ALLOW_THREADS
    if (s == TQ_SUCCESS) return 0;
    tqx_raise_status(st, s);
    return -1;
}

static PyObject *py_amax_update(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "_amax_update(slots, history_len, algo, reduced) takes 4 "
                     "arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_amax_update_args uargs = TQ_AMAX_UPDATE_ARGS_INIT;
    uargs.history_len = PyLong_AsLongLong(args[1]);
    if (uargs.history_len == -1 && PyErr_Occurred()) return NULL;
    if (tqx_amax_algo_from_py(args[2], &uargs.amax_algo) < 0) return NULL;
    if (!PyList_Check(args[0]) && !PyTuple_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "slots must be a list or tuple of (history, scale, "
                     "scaled_max), got %s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "slots must be a list or tuple");
    if (seq == NULL) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    tq_amax_slot *slots = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(tq_amax_slot));
    if (slots == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    int device = TQ_DEVICE_CPU, ok = 1;
    void *stream = NULL;
    for (Py_ssize_t j = 0; j < n && ok; j++)
        ok = slot_from_py(st, PySequence_Fast_GET_ITEM(seq, j), j, uargs.history_len, &device,
                          &stream, &slots[j]) == 0;
    if (ok && args[3] != Py_None) {
        tq_tensor r;
        tqx_tensor_info rinfo;
        ok = tqx_tensor_from_py(st, args[3], "reduced", 1u << TQ_DTYPE_FLOAT32, &r, &rinfo) == 0;
        if (ok && (r.rows * r.cols != n || (r.rows > 1 && r.ld != r.cols))) {
            PyErr_Format(PyExc_ValueError, "reduced must be a contiguous float32 tensor of "
                         "len(slots) = %zd elements, got [%lld, %lld] with row stride %lld", n,
                         (long long)r.rows, (long long)r.cols, (long long)r.ld);
            ok = 0;
        }
        if (ok && n == 0) { /* no history names the device: the reduced buffer does */
            device = r.device;
            stream = rinfo.stream;
        }
        if (ok)
            ok = same_device(&r, "reduced", device, n > 0 ? "slots[0].history" : "reduced") == 0;
        if (ok) uargs.reduced_amax = (const float *)r.data;
    }
    if (ok) ok = run(st, slots, (int64_t)n, &uargs, device, stream) == 0;
    PyMem_Free(slots);
    Py_DECREF(seq); /* the tensors stay alive: the caller holds slots */
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* name of buffer i ("hist_bwd", or "histories[3]" among several) into out */
static const char *buffer_name(char *out, size_t size, const char *name, Py_ssize_t i,
                               Py_ssize_t n) {
    if (n == 1) snprintf(out, size, "%s", name);
    else snprintf(out, size, "%s[%zd]", name, i);
    return out;
}

/* Buffer i's slots (columns first_column...) into slots[], after its checks. */
static int buffer_slots(tqx_state *st, PyObject *history, PyObject *scale, const char *h_name,
                        const char *s_name, int64_t history_len, int64_t columns, int *device,
                        void **stream, int64_t first_column, PyObject *scaled,
                        tq_amax_slot *slots) {
    tq_tensor h, s;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, history, h_name, 1u << TQ_DTYPE_FLOAT32, &h, &info) < 0
        || tqx_tensor_from_py(st, scale, s_name, 1u << TQ_DTYPE_FLOAT32, &s, NULL) < 0)
        return -1;
    if (info.ndim != 2 || h.rows != history_len || h.cols < 1
        || first_column + h.cols > columns || s.rows * s.cols != h.cols
        || (s.rows > 1 && s.ld != s.cols)) {
        PyErr_Format(PyExc_ValueError, "%s must be float32 [history_len, n] = [%lld, n] and %s "
                     "contiguous float32 [n], with %lld columns in all (the update's scaled "
                     "maxes); got %d dims [%lld, %lld] and %lld elements after %lld columns",
                     h_name, (long long)history_len, s_name, (long long)columns, info.ndim,
                     (long long)h.rows, (long long)h.cols, (long long)(s.rows * s.cols),
                     (long long)first_column);
        return -1;
    }
    if (first_column == 0) {
        *device = h.device;
        *stream = info.stream;
    } else if (same_device(&h, h_name, *device, "the first history") < 0) {
        return -1;
    }
    if (same_device(&s, s_name, h.device, h_name) < 0) return -1;
    for (int64_t j = 0; j < h.cols; j++) {
        const double scaled_max = PyFloat_AsDouble(PyTuple_GET_ITEM(scaled, first_column + j));
        if (scaled_max == -1.0 && PyErr_Occurred()) return -1;
        tq_amax_slot *slot = &slots[first_column + j];
        slot->history = (float *)h.data + j;
        slot->stride = h.rows > 1 ? h.ld : 1;
        slot->scale = (float *)s.data + j;
        slot->scaled_max = (float)scaled_max; /* as slot_from_py rounds it */
    }
    return (int)h.cols;
}

/* update = (history_len, algo, tuple of scaled maxes) -> uargs and *scaled (borrowed). */
static int parse_update(PyObject *update, tq_amax_update_args *uargs, PyObject **scaled) {
    PyObject *algo;
    if (!PyTuple_Check(update)
        || !PyArg_ParseTuple(update, "LOO!", &uargs->history_len, &algo, &PyTuple_Type, scaled)) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "a delayed update is (history_len, algo, tuple of "
                            "scaled maxes)");
        }
        return -1;
    }
    return tqx_amax_algo_from_py(algo, &uargs->amax_algo);
}

int tqx_amax_update_one(tqx_state *st, PyObject *history, PyObject *scale, PyObject *update,
                        tqx_update *out) {
    const tq_amax_update_args init = TQ_AMAX_UPDATE_ARGS_INIT;
    PyObject *scaled;
    out->args = init;
    out->done = 0;
    if (parse_update(update, &out->args, &scaled) < 0) return -1;
    if (PyTuple_GET_SIZE(scaled) != 1) {
        PyErr_Format(PyExc_ValueError, "a one-column update has one scaled max, got %zd",
                     PyTuple_GET_SIZE(scaled));
        return -1;
    }
    const int c = buffer_slots(st, history, scale, "hist_bwd", "scale_bwd", out->args.history_len,
                               1, &out->args.device, &out->stream, 0, scaled, &out->slot);
    return c < 0 ? -1 : 0;
}

int tqx_amax_update_run(tqx_state *st, tqx_update *u) {
    return run(st, &u->slot, 1, &u->args, u->args.device, u->stream);
}

int tqx_amax_update_buffers(tqx_state *st, Py_ssize_t n_buffers, PyObject *const *histories,
                            PyObject *const *scales, PyObject *update, PyObject *reduced,
                            const char *history_name, const char *scale_name) {
    tq_amax_update_args uargs = TQ_AMAX_UPDATE_ARGS_INIT;
    PyObject *scaled;
    if (parse_update(update, &uargs, &scaled) < 0) return -1;
    const Py_ssize_t n = PyTuple_GET_SIZE(scaled);
    if (n_buffers < 1 || n < 1) {
        PyErr_SetString(PyExc_ValueError, "a delayed update needs at least one history and "
                        "one scaled max");
        return -1;
    }
    /* a module's few columns on the stack; a batch of modules' (the compiled forward update) on
     * the heap */
    tq_amax_slot few[TQX_UPDATE_COLUMNS];
    tq_amax_slot *slots = n <= TQX_UPDATE_COLUMNS ? few : PyMem_Malloc(sizeof(*slots) * (size_t)n);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int device = TQ_DEVICE_CPU, rc = 0;
    void *stream = NULL;
    int64_t column = 0;
    char h_name[48], s_name[48];
    for (Py_ssize_t i = 0; i < n_buffers && rc == 0; i++) {
        const int c = buffer_slots(st, histories[i], scales[i],
                                   buffer_name(h_name, sizeof h_name, history_name, i, n_buffers),
                                   buffer_name(s_name, sizeof s_name, scale_name, i, n_buffers),
                                   uargs.history_len, n, &device, &stream, column, scaled, slots);
        if (c < 0) rc = -1;
        else column += c;
    }
    if (rc == 0 && column != n) {
        PyErr_Format(PyExc_ValueError, "the histories have %lld columns in all; the update has "
                     "%zd scaled maxes", (long long)column, n);
        rc = -1;
    }
    if (rc == 0 && reduced != NULL && reduced != Py_None) {
        tq_tensor r;
        rc = tqx_tensor_from_py(st, reduced, "reduced", 1u << TQ_DTYPE_FLOAT32, &r, NULL);
        if (rc == 0 && (r.rows * r.cols != n || (r.rows > 1 && r.ld != r.cols))) {
            PyErr_Format(PyExc_ValueError, "reduced must be a contiguous float32 tensor of %zd "
                         "elements (one per column), got [%lld, %lld] with row stride %lld", n,
                         (long long)r.rows, (long long)r.cols, (long long)r.ld);
            rc = -1;
        }
        if (rc == 0) rc = same_device(&r, "reduced", device, "the first history");
        if (rc == 0) uargs.reduced_amax = (const float *)r.data;
    }
    if (rc == 0) rc = run(st, slots, (int64_t)n, &uargs, device, stream);
    if (slots != few) PyMem_Free(slots);
    return rc;
}

/* _amax_update_buffers(histories, scales, update, reduced): the fused update of every column
 * of a list of float32 [L, c_i] histories and their [c_i] scales, in place. */
static PyObject *py_amax_update_buffers(PyObject *module, PyObject *const *args,
                                        Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "_amax_update_buffers(histories, scales, update, "
                        "reduced)");
        return NULL;
    }
    if (!PyList_Check(args[0]) || !PyList_Check(args[1])
        || PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_amax_update_buffers: histories and scales must be "
                        "lists of the same length");
        return NULL;
    }
    PyObject **h = PySequence_Fast_ITEMS(args[0]), **s = PySequence_Fast_ITEMS(args[1]);
    if (tqx_amax_update_buffers(tqx_module_state(module), PyList_GET_SIZE(args[0]), h, s,
                                args[2], args[3], "histories", "scales") < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyMethodDef tqx_amax_update_methods[] = {
    {"_amax_update_buffers", (PyCFunction)(void (*)(void))py_amax_update_buffers, METH_FASTCALL,
     "_amax_update_buffers(histories, scales, update, reduced)\n\nDelayed scaling's fused roll "
     "and scale update, in place, of every column of a list of float32 [L, c_i] histories and "
     "their contiguous float32 [c_i] scales (one C call). update: (L, algo, tuple of the sum of "
     "c_i scaled maxes), algo 'max' or 'most_recent'; reduced: None or a contiguous float32 "
     "tensor of one all-reduced amax per column."},
    {"_amax_update", (PyCFunction)(void (*)(void))py_amax_update, METH_FASTCALL,
     "_amax_update(slots, history_len, algo, reduced)\n\nDelayed scaling's amax-history roll and "
     "scale update, in place. slots: list/tuple of (history [L, 1] float32 view, scale float32 "
     "[1], scaled_max float); algo: 'max' or 'most_recent'; reduced: None or a contiguous "
     "float32 tensor of len(slots) all-reduced amaxes (0 entries fall back to history[0])."},
    {NULL, NULL, 0, NULL}};

/* linear_delayed.c: DelayedScaling's module buffers as the compiled te.Linear ops take them
 * (linear_ops.c): the checks of a history and scale, the (scale, amax slot) states the quantizers
 * cast with and accumulate into, and those states kept per buffer between calls (kept_states).
 * Tests: tests/test_compile_delayed.py (test_in_place_ops_follow_replaced_buffers and the ops'
 * tests), tests/test_compile.py.
 */
#include "module.h"

/* slice(start, start + 1) (new reference) */
static PyObject *one_slice(Py_ssize_t start) {
    PyObject *a = PyLong_FromSsize_t(start), *b = PyLong_FromSsize_t(start + 1);
    PyObject *slice = a && b ? PySlice_New(a, b, NULL) : NULL;
    Py_XDECREF(a);
    Py_XDECREF(b);
    return slice;
}

/* DelayedScaling's (scale[column:column + 1], amax slot) pair: the [1, 1] slot history[0:1,
 * column:column + 1] of the op's copy of a history (shaped as a fresh slot: a members output
 * copies it), or without one (history NULL) a fresh zeroed [1, 1] on device (new reference). */
PyObject *tqx_delayed_state(tqx_state *st, PyObject *scale, Py_ssize_t column, PyObject *device,
                            PyObject *history) {
    void *data;
    PyObject *slot = PySequence_GetSlice(scale, column, column + 1), *amax = NULL;
    if (slot != NULL && history != NULL) {
        PyObject *rows = one_slice(0), *cols = one_slice(column);
        PyObject *index = rows && cols ? PyTuple_Pack(2, rows, cols) : NULL;
        PyObject *view = index ? PyObject_GetItem(history, index) : NULL;
        /* strides (1, 1), a fresh slot's: a copy of it (a member) keeps them */
        amax = view ? PyObject_CallMethod(view, "view", "ii", 1, 1) : NULL;
        Py_XDECREF(view);
        Py_XDECREF(index);
        Py_XDECREF(rows);
        Py_XDECREF(cols);
    } else if (slot != NULL) {
        amax = tqx_torch_new(st, 1, 1, TQ_DTYPE_FLOAT32, device, 1, &data);
    }
    PyObject *pair = amax ? PyTuple_Pack(2, slot, amax) : NULL;
    Py_XDECREF(slot);
    Py_XDECREF(amax);
    return pair;
}

/* Drops what a tqx_delayed_buffers holds (module.h: the history, the scale, their states). */
void tqx_delayed_buffers_clear(tqx_delayed_buffers *c) {
    Py_CLEAR(c->hist);
    Py_CLEAR(c->scale);
    Py_CLEAR(c->states[0]);
    Py_CLEAR(c->states[1]);
}

/* Checks hist (float32 [rows, cols]; rows: `rows`, or any >= 1 when 0) and scale (float32,
 * cols elements) on like's device; -1 with ValueError naming them. */
static int check_buffers(tqx_state *st, const char *fn, PyObject *hist, const char *hist_name,
                         PyObject *scale, const char *scale_name, int64_t rows, int64_t cols,
                         PyObject *like, void **data) {
    tq_tensor h, s, l;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, hist, hist_name, 1u << TQ_DTYPE_FLOAT32, &h, &info) < 0
        || tqx_tensor_from_py(st, scale, scale_name, 1u << TQ_DTYPE_FLOAT32, &s, NULL) < 0
        || tqx_tensor_from_py(st, like, "its input", ~0u, &l, NULL) < 0)
        return -1;
    char want[32], got[32], on[32];
    if (rows) snprintf(want, sizeof want, "%lld", (long long)rows);
    else snprintf(want, sizeof want, "history_len");
    if (info.ndim != 2 || h.cols != cols || h.rows < 1 || (rows && h.rows != rows)
        || s.rows * s.cols != cols) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be float32 [%s, %lld] and %s float32 [%lld]; "
                     "got %d dims [%lld, %lld] and %lld elements", fn, hist_name, want,
                     (long long)cols, scale_name, (long long)cols, info.ndim, (long long)h.rows,
                     (long long)h.cols, (long long)(s.rows * s.cols));
        return -1;
    }
    if (h.device != l.device || s.device != l.device) {
        tqx_device_name(l.device, want, sizeof want);
        tqx_device_name(h.device, got, sizeof got);
        tqx_device_name(s.device, on, sizeof on);
        PyErr_Format(PyExc_ValueError, "%s: %s (on %s) and %s (on %s) must be on the input's "
                     "device, %s", fn, hist_name, got, scale_name, on, want);
        return -1;
    }
    data[0] = h.data;
    data[1] = s.data;
    return 0;
}

/* The states of a module's own buffers, kept between calls: the slot views cost ~14 us per
 * forward through torch's indexing (3 views a state), and a compiled step hands the ops the
 * same buffer objects every time. An entry (weakref hist, weakref scale, hist data, scale data,
 * states) under hist's address is used while both objects are alive, the same pair and on the
 * same storage (`.data =` and load_state_dict(assign=True) replace it), as delayed.py's _kept
 * keeps eager's. An entry leaves when its history dies (the weakref's callback: its views would
 * keep the storage alive), and the whole table is cleared once it holds TQX_KEPT_STATES_MAX
 * entries (fresh tensors each call, e.g. functionalization's copies under aot_eager). */
#define TQX_KEPT_STATES_MAX 4096

/* The history weakref's callback, bound to (table, key): drops the entry if it is still ref's. */
static PyObject *drop_kept(PyObject *bound, PyObject *ref) {
    PyObject *table = PyTuple_GET_ITEM(bound, 0), *key = PyTuple_GET_ITEM(bound, 1);
    PyObject *entry = PyDict_GetItemWithError(table, key);
    if (entry != NULL && PyTuple_GET_ITEM(entry, 0) == ref && PyDict_DelItem(table, key) < 0)
        return NULL;
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef drop_kept_def = {"_drop_kept_states", drop_kept, METH_O,
                                    "Drops a dead history's kept DelayedScaling states."};

static PyObject *weak_target(PyObject *ref) { /* borrowed; NULL when dead */
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *target = NULL;
    if (PyWeakref_GetRef(ref, &target) < 0) PyErr_Clear();
    Py_XDECREF(target); /* the entry's key object is alive while the caller holds it */
    return target;
#else
    PyObject *target = PyWeakref_GetObject(ref);
    return target == Py_None ? NULL : target;
#endif
}

static PyObject *kept_states(tqx_state *st, PyObject *key, PyObject *hist, PyObject *scale,
                             void *const *data) { /* borrowed; NULL (no error) on a miss */
    PyObject *entry = st->delayed_states ? PyDict_GetItemWithError(st->delayed_states, key)
                                         : NULL;
    if (entry == NULL) return NULL;
    if (weak_target(PyTuple_GET_ITEM(entry, 0)) != hist
        || weak_target(PyTuple_GET_ITEM(entry, 1)) != scale
        || PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 2)) != data[0]
        || PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 3)) != data[1])
        return NULL;
    return PyTuple_GET_ITEM(entry, 4);
}

static int keep_states(tqx_state *st, PyObject *key, PyObject *hist, PyObject *scale,
                       void *const *data, PyObject *states) {
    if (st->delayed_states == NULL && (st->delayed_states = PyDict_New()) == NULL) return -1;
    if (PyDict_GET_SIZE(st->delayed_states) >= TQX_KEPT_STATES_MAX)
        PyDict_Clear(st->delayed_states);
    PyObject *bound = PyTuple_Pack(2, st->delayed_states, key);
    PyObject *drop = bound ? PyCFunction_New(&drop_kept_def, bound) : NULL;
    Py_XDECREF(bound);
    PyObject *h = drop ? PyWeakref_NewRef(hist, drop) : NULL;
    PyObject *s = h ? PyWeakref_NewRef(scale, NULL) : NULL;
    Py_XDECREF(drop);
    PyObject *hd = s ? PyLong_FromVoidPtr(data[0]) : NULL;
    PyObject *sd = hd ? PyLong_FromVoidPtr(data[1]) : NULL;
    PyObject *entry = sd ? PyTuple_Pack(5, h, s, hd, sd, states) : NULL;
    const int rc = entry ? PyDict_SetItem(st->delayed_states, key, entry) : -1;
    Py_XDECREF(h);
    Py_XDECREF(s);
    Py_XDECREF(hd);
    Py_XDECREF(sd);
    Py_XDECREF(entry);
    return rc;
}

/* Fills *c for the module buffers hist, scale of a recipe entry at `step`; like: the op's input
 * (its device). in_place: c holds the buffers themselves (new references), not copies. -1 with
 * an exception. */
int tqx_delayed_copies(tqx_state *st, PyObject *entry, tqx_delayed_step step, PyObject *hist,
                       PyObject *scale, PyObject *like, int in_place, tqx_delayed_buffers *c) {
    const int backward = step != TQX_DELAYED_FORWARD;
    const char *fn = backward ? "linear_bwd" : "linear_fwd";
    PyObject *update = PyTuple_GET_ITEM(entry, 1);
    int64_t rows = 0;
    if (step == TQX_DELAYED_BACKWARD && update == Py_None) {
        PyErr_Format(PyExc_ValueError, "%s: hist_bwd is for DelayedScaling with the fused update "
                     "rule ('max' or 'most_recent', no scaling_factor_compute_algo) or a deferred "
                     "update; this recipe updates in Python: pass hist_bwd None", fn);
        return -1;
    }
    if (step == TQX_DELAYED_BACKWARD) {
        rows = PyLong_AsLongLong(PyTuple_GET_ITEM(update, 0));
        if (rows == -1 && PyErr_Occurred()) return -1;
    }
    void *data[2];
    if (check_buffers(st, fn, hist, backward ? "hist_bwd" : "hist_fwd", scale,
                      backward ? "scale_bwd" : "scale_fwd", rows, backward ? 1 : 2, like, data)
            < 0
        || (c->hist = in_place ? Py_NewRef(hist) : PyObject_CallMethod(hist, "clone", NULL))
               == NULL
        || (backward && (c->scale = in_place ? Py_NewRef(scale)
                                             : PyObject_CallMethod(scale, "clone", NULL)) == NULL))
        return -1;
    const int n = backward ? 1 : 2;
    PyObject *key = in_place ? PyLong_FromVoidPtr(hist) : NULL, *kept = NULL;
    if (in_place && (key == NULL || ((kept = kept_states(st, key, hist, scale, data)) == NULL
                                     && PyErr_Occurred()))) {
        Py_XDECREF(key);
        return -1;
    }
    /* Kept views are made from detached aliases: a view would keep the buffer's own Python
     * object alive (torch preserves a tensor's PyObject while a view of it lives), and with it
     * the entry, whose weakref would never die. */
    PyObject *h_of = NULL, *s_of = NULL;
    if (in_place && kept == NULL
        && ((h_of = PyObject_CallMethod(hist, "detach", NULL)) == NULL
            || (s_of = PyObject_CallMethod(scale, "detach", NULL)) == NULL)) {
        Py_XDECREF(h_of);
        Py_DECREF(key);
        return -1;
    }
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++)
        if ((c->states[i] = kept ? Py_NewRef(PyTuple_GET_ITEM(kept, i))
                                 : tqx_delayed_state(st, s_of ? s_of : scale, i, NULL,
                                                     h_of ? h_of : c->hist)) == NULL)
            rc = -1;
    Py_XDECREF(h_of);
    Py_XDECREF(s_of);
    if (rc == 0 && in_place && kept == NULL) {
        PyObject *states = PyTuple_Pack(n, c->states[0], n > 1 ? c->states[1] : NULL);
        rc = states ? keep_states(st, key, hist, scale, data, states) : -1;
        Py_XDECREF(states);
    }
    Py_XDECREF(key);
    return rc;
}

PyObject *tqx_kept_states_count(PyObject *module, PyObject *unused) {
    (void)unused;
    const tqx_state *st = tqx_module_state(module);
    return PyLong_FromSsize_t(st->delayed_states ? PyDict_GET_SIZE(st->delayed_states) : 0);
}

/* tensor_view.c: torch.Tensor -> tq_tensor (a 2-D row-major view) through the DLPack C exchange
 * API (`type(t).__dlpack_c_exchange_api__`): pointer, shape, strides, dtype, device and the
 * framework's current CUDA stream, without linking libtorch and without a Python call per
 * tensor. The table is cached per tensor type.
 *
 * A tensor of any rank is viewed as [prod(leading dims), last dim] with a row stride `ld`; that
 * needs the last dim contiguous and the leading dims mergeable. Anything else (a transposed
 * view, broadcast strides, an unsupported dtype or device) gets a ValueError or
 * NotImplementedError that names the tensor, what it got and what is expected.
 * Tests: tests/test_tensor_view.py.
 */
#include <stdio.h>
#include <string.h>

#include "module.h"

static const char *const device_type_names[] = {
    [kDLCPU] = "cpu", [kDLCUDA] = "cuda", [kDLCUDAHost] = "cuda pinned host",
    [kDLROCM] = "rocm", [kDLCUDAManaged] = "cuda managed"};

static int find_api(PyObject *type_obj, const DLPackExchangeAPI **out) {
    PyObject *capsule = PyObject_GetAttrString(type_obj, "__dlpack_c_exchange_api__");
    if (capsule == NULL) return -1;
    const DLPackExchangeAPIHeader *h = PyCapsule_GetPointer(capsule, "dlpack_exchange_api");
    Py_DECREF(capsule); /* the table itself lives for the whole process (DLPack's rule) */
    if (h == NULL) return -1;
    while (h != NULL && h->version.major != TQX_DLPACK_MAJOR) h = h->prev_api;
    if (h == NULL) {
        PyErr_SetString(PyExc_NotImplementedError, "this torch's DLPack exchange API has no "
                        "version 1.x table; tequant needs DLPack 1.x (torch >= 2.10)");
        return -1;
    }
    const DLPackExchangeAPI *api = (const DLPackExchangeAPI *)h;
    if (api->dltensor_from_py_object_no_sync == NULL || api->current_work_stream == NULL) {
        PyErr_SetString(PyExc_NotImplementedError, "this torch's DLPack exchange API lacks "
                        "dltensor_from_py_object_no_sync/current_work_stream");
        return -1;
    }
    *out = api;
    return 0;
}

static const DLPackExchangeAPI *exchange_api(tqx_state *st, PyObject *obj, const char *name) {
    PyTypeObject *type = Py_TYPE(obj);
    if (type == st->dlpack_type) return st->dlpack_api;
    const DLPackExchangeAPI *api;
    if (find_api((PyObject *)type, &api) < 0) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be a torch.Tensor, got %s", name, type->tp_name);
        }
        return NULL;
    }
    /* One type cached: torch.Tensor and nn.Parameter share the table, so a miss costs only an
     * attribute lookup. */
    Py_INCREF(type);
    Py_XSETREF(st->dlpack_type, type);
    st->dlpack_api = api;
    return api;
}

static int map_dtype(DLDataType t, tq_dtype *out) {
    if (t.lanes != 1) return -1;
    switch (t.code) {
        case kDLFloat:
            if (t.bits == 32) return *out = TQ_DTYPE_FLOAT32, 0;
            if (t.bits == 16) return *out = TQ_DTYPE_FLOAT16, 0;
            return -1;
        case kDLBfloat: return t.bits == 16 ? (*out = TQ_DTYPE_BFLOAT16, 0) : -1;
        case kDLFloat8_e4m3fn: return t.bits == 8 ? (*out = TQ_DTYPE_FLOAT8_E4M3, 0) : -1;
        case kDLFloat8_e5m2: return t.bits == 8 ? (*out = TQ_DTYPE_FLOAT8_E5M2, 0) : -1;
        case kDLFloat8_e8m0fnu: return t.bits == 8 ? (*out = TQ_DTYPE_FLOAT8_E8M0, 0) : -1;
        case kDLUInt: return t.bits == 8 ? (*out = TQ_DTYPE_UINT8, 0) : -1;
        case kDLInt:
            if (t.bits == 32) return *out = TQ_DTYPE_INT32, 0;
            if (t.bits == 64) return *out = TQ_DTYPE_INT64, 0;
            return -1;
        default: return -1;
    }
}

static void describe_dtype(DLDataType t, char *buf, size_t cap) {
    static const char *const codes[] = {"int", "uint", "float", "opaque", "bfloat", "complex"};
    static const char *const fp8_names[] = {[7] = "float8_e3m4", [8] = "float8_e4m3",
        [9] = "float8_e4m3b11fnuz", [11] = "float8_e4m3fnuz", [13] = "float8_e5m2fnuz",
        [15] = "float6_e2m3fn", [16] = "float6_e3m2fn", [17] = "float4_e2m1fn"};
    tq_dtype d;
    if (map_dtype(t, &d) == 0)
        snprintf(buf, cap, "%s", tq_dtype_name(d));
    else if (t.code == kDLBool)
        snprintf(buf, cap, "bool");
    else if (t.code < sizeof fp8_names / sizeof fp8_names[0] && fp8_names[t.code])
        snprintf(buf, cap, "%s", fp8_names[t.code]);
    else if (t.code < sizeof codes / sizeof codes[0])
        snprintf(buf, cap, "%s%d", codes[t.code], (int)t.bits);
    else
        snprintf(buf, cap, "DLPack dtype code %d with %d bits", (int)t.code, (int)t.bits);
}

static void describe_mask(uint32_t mask, char *buf, size_t cap) {
    size_t used = 0;
    buf[0] = '\0';
    for (int d = 0; d < TQ_DTYPE_COUNT_ && used + 1 < cap; d++)
        if (mask & (1u << d))
            used += (size_t)snprintf(buf + used, cap - used, "%s%s", used ? ", " : "",
                                     tq_dtype_name((tq_dtype)d));
}

static void describe_dims(const int64_t *v, int n, char *buf, size_t cap) {
    size_t used = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n && used + 1 < cap; i++)
        used += (size_t)snprintf(buf + used, cap - used, "%s%lld", i ? ", " : "", (long long)v[i]);
    if (used + 1 < cap) snprintf(buf + used, cap - used, n == 1 ? ",)" : ")");
}

/* Merges the leading dims into rows with one row stride; -1 with ValueError if they do not.
 * A tensor with no elements always has a valid (empty) view. */
static int flatten(const DLTensor *dl, const char *name, tq_tensor *out) {
    const int n = dl->ndim;
    if (n == 0) {
        out->rows = out->cols = out->ld = 1;
        return 0;
    }
    const int64_t cols = dl->shape[n - 1];
    int64_t rows = 1;
    for (int i = 0; i < n - 1; i++) rows *= dl->shape[i];
    int64_t ld = -1, next = 0;
    int ok = cols <= 1 || dl->strides[n - 1] == 1;
    for (int i = n - 2; i >= 0 && ok; i--) {
        if (dl->shape[i] == 1) continue; /* a size-1 dim's stride is meaningless */
        if (ld < 0) {
            ld = dl->strides[i];
            next = ld * dl->shape[i];
        } else {
            ok = dl->strides[i] == next;
            next *= dl->shape[i];
        }
    }
    if (ok && rows > 1 && ld < cols) ok = 0; /* overlapping rows (broadcast / expand) */
    if (rows * cols == 0) ok = 1; /* no element is addressed: any layout is a valid view */
    if (!ok) {
        char shape[160], strides[160];
        describe_dims(dl->shape, n, shape, sizeof shape);
        describe_dims(dl->strides, n, strides, sizeof strides);
        PyErr_Format(PyExc_ValueError, "%s has shape %s and strides %s: tequant needs the last dim "
                     "contiguous (stride 1) and the leading dims mergeable into rows with one row "
                     "stride; pass %s.contiguous()", name, shape, strides, name);
        return -1;
    }
    out->rows = rows;
    out->cols = cols;
    out->ld = ld < cols ? cols : ld;
    return 0;
}

/* torch could not describe the tensor (meta, sparse, ...): name the device when that is why. */
static int export_failed(PyObject *obj, const char *name) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *dev = PyObject_GetAttrString(obj, "device");
    PyObject *dev_type = dev ? PyObject_GetAttrString(dev, "type") : NULL;
    Py_XDECREF(dev);
    const char *t = dev_type && PyUnicode_Check(dev_type) ? PyUnicode_AsUTF8(dev_type) : NULL;
    if (t != NULL && strcmp(t, "cpu") != 0 && strcmp(t, "cuda") != 0) {
        PyErr_Format(PyExc_NotImplementedError, "%s is on a %s device; tequant runs on CPU and "
                     "CUDA tensors", name, t);
        Py_DECREF(dev_type);
        Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(tb);
        return -1;
    }
    PyErr_Clear();
    Py_XDECREF(dev_type);
    PyErr_Restore(type, value, tb); /* a CPU/CUDA tensor torch refused: keep torch's reason */
    return -1;
}

int tqx_tensor_from_py(tqx_state *st, PyObject *obj, const char *name, uint32_t dtype_mask,
                       tq_tensor *out, tqx_tensor_info *info) {
    const DLPackExchangeAPI *api = exchange_api(st, obj, name);
    if (api == NULL) return -1;
    DLTensor dl;
    if (api->dltensor_from_py_object_no_sync(obj, &dl) != 0) return export_failed(obj, name);
    tq_dtype dtype;
    if (map_dtype(dl.dtype, &dtype) < 0 || !(dtype_mask & (1u << dtype))) {
        char got[64], want[256];
        describe_dtype(dl.dtype, got, sizeof got);
        describe_mask(dtype_mask, want, sizeof want);
        PyErr_Format(PyExc_ValueError, "%s has dtype %s; expected one of: %s", name, got, want);
        return -1;
    }
    int device;
    if (dl.device.device_type == kDLCPU) {
        device = TQ_DEVICE_CPU;
    } else if (dl.device.device_type == kDLCUDA) {
        device = dl.device.device_id;
    } else {
        int t = dl.device.device_type;
        const char *dev = t > 0 && t <= kDLCUDAManaged && device_type_names[t] ? device_type_names[t]
                                                                              : "non-CPU/CUDA";
        PyErr_Format(PyExc_NotImplementedError, "%s is on a %s device (DLPack device type %d); "
                     "tequant runs on CPU and CUDA tensors", name, dev, t);
        return -1;
    }
    if (dl.ndim > 8) {
        PyErr_Format(PyExc_ValueError, "%s has %d dims; tequant takes at most 8", name, dl.ndim);
        return -1;
    }
    if (flatten(&dl, name, out) < 0) return -1;
    out->data = dl.data ? (char *)dl.data + dl.byte_offset : NULL;
    out->dtype = dtype;
    out->device = device;
    if (info != NULL) {
        info->ndim = dl.ndim;
        for (int i = 0; i < dl.ndim; i++) info->shape[i] = dl.shape[i];
        info->stream = NULL;
        if (device != TQ_DEVICE_CPU
            && api->current_work_stream(kDLCUDA, device, &info->stream) != 0)
            return -1;
    }
    return 0;
}

int tqx_optional_tensor(tqx_state *st, PyObject *obj, const char *name, uint32_t dtype_mask,
                        tq_tensor *out) {
    const tq_tensor none = {0};
    *out = none;
    if (obj == NULL || obj == Py_None) return 0;
    return tqx_tensor_from_py(st, obj, name, dtype_mask, out, NULL);
}

int tqx_required(PyObject *obj, const char *fn, const char *name) {
    if (obj != NULL && obj != Py_None) return 0;
    PyErr_Format(PyExc_TypeError, "%s() missing required keyword argument '%s' (a tensor)", fn,
                 name);
    return -1;
}

/* ---- Python: _tensor_view(x, name="x", dtypes=None) -> dict (for tests and debugging) ---- */

static int mask_from_names(PyObject *names, uint32_t *mask) {
    if (names == Py_None) { /* every dtype a torch tensor can have (packed E2M1 travels as uint8) */
        *mask = ((1u << TQ_DTYPE_COUNT_) - 1) & ~(1u << TQ_DTYPE_FLOAT4_E2M1X2);
        return 0;
    }
    if (PyUnicode_Check(names)) {
        PyErr_Format(PyExc_TypeError, "dtypes must be a sequence of dtype names, not a str (%R); "
                     "write [%R]", names, names);
        return -1;
    }
    PyObject *seq = PySequence_Fast(names, "dtypes must be a sequence of dtype names");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) == 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "dtypes is empty: name at least one dtype");
        return -1;
    }
    *mask = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyUnicode_Check(item)) {
            PyErr_Format(PyExc_TypeError, "dtypes must hold dtype names (str), got %s",
                         Py_TYPE(item)->tp_name);
            Py_DECREF(seq);
            return -1;
        }
        const char *s = PyUnicode_AsUTF8(item);
        int found = 0;
        for (int d = 0; s != NULL && d < TQ_DTYPE_COUNT_; d++)
            if (strcmp(s, tq_dtype_name((tq_dtype)d)) == 0) *mask |= 1u << d, found = 1;
        if (!found) {
            if (s != NULL) PyErr_Format(PyExc_ValueError, "unknown dtype name %R", PySequence_Fast_GET_ITEM(seq, i));
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *py_tensor_view(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"x", "name", "dtypes", NULL};
    PyObject *x, *dtypes = Py_None;
    const char *name = "x";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|sO:_tensor_view", kwlist, &x, &name, &dtypes))
        return NULL;
    uint32_t mask;
    if (mask_from_names(dtypes, &mask) < 0) return NULL;
    tq_tensor t;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(tqx_module_state(module), x, name, mask, &t, &info) < 0) return NULL;
    PyObject *shape = PyTuple_New(info.ndim);
    if (shape == NULL) return NULL;
    for (int i = 0; i < info.ndim; i++) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(info.shape[i]));
    return Py_BuildValue("{s:K,s:L,s:L,s:L,s:s,s:i,s:N,s:K}", "data_ptr",
                         (unsigned long long)(uintptr_t)t.data, "rows", (long long)t.rows, "cols",
                         (long long)t.cols, "ld", (long long)t.ld, "dtype", tq_dtype_name(t.dtype),
                         "device", t.device, "shape", shape, "stream",
                         (unsigned long long)(uintptr_t)info.stream);
}

PyMethodDef tqx_tensor_view_methods[] = {
    {"_tensor_view", (PyCFunction)(void (*)(void))py_tensor_view, METH_VARARGS | METH_KEYWORDS,
     "_tensor_view(x, name='x', dtypes=None) -> dict\n\nThe descriptor tequant's C code sees for "
     "tensor x (data pointer, rows, cols, ld, dtype, device, current CUDA stream)."},
    {NULL, NULL, 0, NULL}};

/* torch_calls.c: the torch functions the extension calls from C (torch.empty, torch.zeros,
 * torch.mm) and the torch dtypes it allocates with, looked up once into the module state.
 * Allocation always goes through torch (its caching allocator on CUDA, never cudaMalloc), and
 * the new tensor's pointer is read back through DLPack (tensor_view.c).
 * Tests: tests/test_quantize_*.py and tests/test_gemm.py allocate through here.
 */
#include "module.h"

static const char *const dtype_names[TQX_TORCH_DTYPE_COUNT] = {
    [TQX_TORCH_FLOAT32] = "float32",     [TQX_TORCH_UINT8] = "uint8",
    [TQX_TORCH_FLOAT8_E4M3] = "float8_e4m3fn", [TQX_TORCH_FLOAT8_E5M2] = "float8_e5m2",
    [TQX_TORCH_FLOAT8_E8M0] = "float8_e8m0fnu", [TQX_TORCH_BFLOAT16] = "bfloat16",
    [TQX_TORCH_FLOAT16] = "float16"};

int tqx_torch_import(tqx_state *st) {
    if (st->torch_mm != NULL) return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) return -1;
    int ok = 1;
    for (int i = 0; i < TQX_TORCH_DTYPE_COUNT && ok; i++)
        ok = (st->torch_dtypes[i] = PyObject_GetAttrString(torch, dtype_names[i])) != NULL;
    if (ok) ok = (st->torch_zeros = PyObject_GetAttrString(torch, "zeros")) != NULL;
    if (ok) ok = (st->torch_empty = PyObject_GetAttrString(torch, "empty")) != NULL;
    if (ok) ok = (st->torch_is_autocast_enabled = PyObject_GetAttrString(torch, "is_autocast_enabled")) != NULL;
    if (ok) ok = (st->torch_set_autocast_enabled = PyObject_GetAttrString(torch, "set_autocast_enabled")) != NULL;
    if (ok) ok = (st->kw_dtype_device = Py_BuildValue("(ss)", "dtype", "device")) != NULL;
    if (ok) ok = (st->torch_mm = PyObject_GetAttrString(torch, "mm")) != NULL;
    Py_DECREF(torch);
    if (!ok) tqx_torch_clear(st); /* all or nothing: torch_mm marks a complete import */
    return ok ? 0 : -1;
}

PyObject *tqx_torch_dtype_of(tqx_state *st, tq_dtype d) {
    switch (d) {
        case TQ_DTYPE_FLOAT32: return st->torch_dtypes[TQX_TORCH_FLOAT32];
        case TQ_DTYPE_BFLOAT16: return st->torch_dtypes[TQX_TORCH_BFLOAT16];
        case TQ_DTYPE_FLOAT16: return st->torch_dtypes[TQX_TORCH_FLOAT16];
        case TQ_DTYPE_FLOAT8_E4M3: return st->torch_dtypes[TQX_TORCH_FLOAT8_E4M3];
        case TQ_DTYPE_FLOAT8_E5M2: return st->torch_dtypes[TQX_TORCH_FLOAT8_E5M2];
        case TQ_DTYPE_FLOAT8_E8M0: return st->torch_dtypes[TQX_TORCH_FLOAT8_E8M0];
        default: return st->torch_dtypes[TQX_TORCH_UINT8]; /* bytes, packed E2M1 pairs */
    }
}

tq_dtype tqx_dtype_of_torch(tqx_state *st, PyObject *dtype) {
    if (dtype == st->torch_dtypes[TQX_TORCH_FLOAT32]) return TQ_DTYPE_FLOAT32;
    if (dtype == st->torch_dtypes[TQX_TORCH_BFLOAT16]) return TQ_DTYPE_BFLOAT16;
    if (dtype == st->torch_dtypes[TQX_TORCH_FLOAT16]) return TQ_DTYPE_FLOAT16;
    return TQ_DTYPE_COUNT_;
}

static PyObject *new_tensor(tqx_state *st, PyObject *shape, tq_dtype dtype, PyObject *device,
                            int zeroed, void **data) {
    PyObject *args[3] = {shape, tqx_torch_dtype_of(st, dtype), device};
    PyObject *tensor = PyObject_Vectorcall(zeroed ? st->torch_zeros : st->torch_empty, args, 1,
                                           st->kw_dtype_device);
    if (tensor == NULL) return NULL;
    tq_tensor view;
    if (tqx_tensor_from_py(st, tensor, "a new tensor", ~0u, &view, NULL) < 0) {
        Py_DECREF(tensor);
        return NULL;
    }
    *data = view.data;
    return tensor;
}

PyObject *tqx_torch_new(tqx_state *st, int64_t rows, int64_t cols, tq_dtype dtype,
                        PyObject *device, int zeroed, void **data) {
    if (dtype == TQ_DTYPE_FLOAT4_E2M1X2) cols /= 2;
    PyObject *shape = Py_BuildValue("(LL)", (long long)rows, (long long)cols);
    if (shape == NULL) return NULL;
    PyObject *tensor = new_tensor(st, shape, dtype, device, zeroed, data);
    Py_DECREF(shape);
    return tensor;
}

PyObject *tqx_torch_new_shaped(tqx_state *st, PyObject *shape, tq_dtype dtype, PyObject *device,
                               void **data) {
    return new_tensor(st, shape, dtype, device, 0, data);
}

int tqx_autocast_off(tqx_state *st, const char *device_type, int *was_on) {
    PyObject *on = PyObject_CallFunction(st->torch_is_autocast_enabled, "s", device_type);
    if (on == NULL) return -1;
    *was_on = PyObject_IsTrue(on);
    Py_DECREF(on);
    if (*was_on <= 0) return *was_on;
    PyObject *r = PyObject_CallFunction(st->torch_set_autocast_enabled, "sO", device_type, Py_False);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

int tqx_autocast_restore(tqx_state *st, const char *device_type, int was_on) {
    if (!was_on) return 0;
    PyObject *r = PyObject_CallFunction(st->torch_set_autocast_enabled, "sO", device_type, Py_True);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

void tqx_torch_clear(tqx_state *st) {
    Py_CLEAR(st->torch_empty);
    Py_CLEAR(st->kw_dtype_device);
    Py_CLEAR(st->torch_zeros);
    Py_CLEAR(st->torch_mm);
    Py_CLEAR(st->torch_is_autocast_enabled);
    Py_CLEAR(st->torch_set_autocast_enabled);
    for (int i = 0; i < TQX_TORCH_DTYPE_COUNT; i++) Py_CLEAR(st->torch_dtypes[i]);
    Py_CLEAR(st->gemm_workspaces);
}

int tqx_torch_traverse(tqx_state *st, visitproc visit, void *arg) {
    Py_VISIT(st->torch_empty);
    Py_VISIT(st->kw_dtype_device);
    Py_VISIT(st->torch_zeros);
    Py_VISIT(st->torch_mm);
    Py_VISIT(st->torch_is_autocast_enabled);
    Py_VISIT(st->torch_set_autocast_enabled);
    for (int i = 0; i < TQX_TORCH_DTYPE_COUNT; i++) Py_VISIT(st->torch_dtypes[i]);
    Py_VISIT(st->gemm_workspaces);
    return 0;
}

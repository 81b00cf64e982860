/* torch_calls.c: the torch functions the extension calls from C (torch.empty, torch.zeros,
 * torch.mm, the caching allocator's raw interface) and the torch dtypes it allocates with,
 * looked up once into the module state. Allocation always goes through torch (its caching
 * allocator on CUDA, never cudaMalloc): an empty float or byte tensor through the DLPack
 * exchange table's allocator (no Python argument parsing: on the H100 host a te.Linear forward
 * C call went 35.6 -> 27.4 us and its backward 70.4 -> 39.4 us), other dtypes and zeroed
 * tensors through torch.empty / torch.zeros with the pointer read back through DLPack
 * (tensor_view.c); memory used only within one call is a raw block of the same allocator
 * (tqx_scratch_alloc; tqx_pad_rows copies rows into one, zero-padded to a row multiple). Inside
 * torch.compile's ops, once the process has cudagraph trees, every
 * tensor comes from torch.empty (their deleter rule; tqx_cudagraph_trees_seen, tested in
 * tests/test_compile_ops.py).
 * Tests: tests/test_quantize_*.py and tests/test_gemm.py allocate through here; scratch:
 * tests/test_linear_alloc.py (reused, poisoned blocks; misaligned inputs), tests/test_gemm.py.
 */
#include <stdio.h>

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
    PyObject *torch_c = ok ? PyObject_GetAttrString(torch, "_C") : NULL;
    ok = torch_c != NULL;
    if (ok) ok = (st->tls_has_key = PyObject_GetAttrString(torch_c, "_is_key_in_tls")) != NULL;
    if (ok) ok = (st->tls_get_obj = PyObject_GetAttrString(torch_c, "_get_obj_in_tls")) != NULL;
    if (ok) ok = (st->trees_key = PyUnicode_InternFromString("tree_manager_containers")) != NULL;
    Py_XDECREF(torch_c);
    if (ok) ok = (st->torch_maximum = PyObject_GetAttrString(torch, "maximum")) != NULL;
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

/* The DLPack device of a torch.device (cpu, or cuda with an index), cached for the last device
 * seen: 0; 1 for any other device (the caller takes torch.empty); -1 with an exception. */
static int dl_device_of(tqx_state *st, PyObject *device, DLDevice *out) {
    if (st->alloc_device != NULL) {
        const int same = st->alloc_device == device
                         || PyObject_RichCompareBool(st->alloc_device, device, Py_EQ);
        if (same < 0) return -1;
        if (same) return *out = st->alloc_dl_device, 0;
    }
    PyObject *type = PyObject_GetAttrString(device, "type");
    PyObject *index = type ? PyObject_GetAttrString(device, "index") : NULL;
    int rc = index ? 1 : -1;
    if (index != NULL && PyUnicode_Check(type)) {
        const int cpu = PyUnicode_CompareWithASCIIString(type, "cpu") == 0;
        const int cuda = PyUnicode_CompareWithASCIIString(type, "cuda") == 0;
        if (cpu || (cuda && index != Py_None)) {
            out->device_type = cpu ? kDLCPU : kDLCUDA;
            out->device_id = cpu ? 0 : (int32_t)PyLong_AsLong(index);
            rc = PyErr_Occurred() ? -1 : 0;
        }
    }
    Py_XDECREF(type);
    Py_XDECREF(index);
    if (rc == 0) {
        Py_XSETREF(st->alloc_device, Py_NewRef(device));
        st->alloc_dl_device = *out;
    }
    return rc;
}

typedef struct {
    char message[256];
    int set;
} alloc_error;

static void set_alloc_error(void *ctx, const char *kind, const char *message) {
    alloc_error *e = ctx;
    snprintf(e->message, sizeof e->message, "%s: %s", kind ? kind : "error",
             message ? message : "");
    e->set = 1;
}

/* torch.empty(shape, dtype, device) through the DLPack exchange table's allocator (torch's
 * caching allocator, no Python argument parsing; the gain is in the file's header) for the
 * dtypes DLPack names the same in every torch this builds for (floats, bytes); NULL without an
 * exception where it does not apply (no table yet, another device or dtype), so the caller
 * takes torch.empty. */
static PyObject *exchange_empty(tqx_state *st, PyObject *shape, tq_dtype dtype, PyObject *device,
                                void **data) {
    const DLPackExchangeAPI *api = st->dlpack_api;
    DLDataType dl_dtype = {kDLUInt, 8, 1};
    switch (dtype) {
        case TQ_DTYPE_FLOAT32: dl_dtype.code = kDLFloat, dl_dtype.bits = 32; break;
        case TQ_DTYPE_BFLOAT16: dl_dtype.code = kDLBfloat, dl_dtype.bits = 16; break;
        case TQ_DTYPE_FLOAT16: dl_dtype.code = kDLFloat, dl_dtype.bits = 16; break;
        case TQ_DTYPE_UINT8: case TQ_DTYPE_FLOAT4_E2M1X2: break;
        default: return NULL;
    }
    if (api == NULL || api->managed_tensor_allocator == NULL
        || api->managed_tensor_to_py_object_no_sync == NULL || !PyTuple_Check(shape)
        || PyTuple_GET_SIZE(shape) > 4)
        return NULL;
    DLTensor proto = {0};
    const int found = dl_device_of(st, device, &proto.device);
    if (found != 0) return NULL; /* an exception (found < 0) stays set */
    int64_t dims[4], strides[4];
    proto.ndim = (int32_t)PyTuple_GET_SIZE(shape);
    for (int i = 0; i < proto.ndim; i++) dims[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    if (PyErr_Occurred()) return NULL;
    int64_t step = 1;
    for (int i = proto.ndim - 1; i >= 0; i--) { /* row-major, as torch.empty */
        strides[i] = step;
        step *= dims[i] ? dims[i] : 1;
    }
    proto.shape = dims, proto.strides = strides, proto.dtype = dl_dtype;
    DLManagedTensorVersioned *managed = NULL;
    alloc_error error = {{0}, 0};
    if (api->managed_tensor_allocator(&proto, &managed, &error, set_alloc_error) != 0
        || managed == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_MemoryError, "tensor allocation failed (%s)",
                         error.set ? error.message : "no reason given");
        return NULL;
    }
    *data = (char *)managed->dl_tensor.data + managed->dl_tensor.byte_offset;
    void *tensor = NULL;
    if (api->managed_tensor_to_py_object_no_sync(managed, &tensor) != 0 || tensor == NULL) {
        if (managed->deleter) managed->deleter(managed);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "DLPack tensor to torch.Tensor failed");
        return NULL;
    }
    return tensor;
}

/* Whether cudagraph trees have made a tree-manager container in this process: torch keeps the
 * containers dict of a thread in its TLS (torch._C._stash_obj_in_tls, copied to autograd's
 * threads), present once torch._inductor.cudagraph_trees ran on the thread. Sticky once true
 * (st->trees_seen), even after torch resets its trees; the answer that is always safe (1) where
 * torch's internals are not as expected. */
int tqx_cudagraph_trees_seen(tqx_state *st) {
    if (st->trees_seen) return 1;
    if (PyDict_GetItemString(PyImport_GetModuleDict(), "torch._inductor.cudagraph_trees") == NULL)
        return 0; /* never imported: torch.compile has made no CUDA graph */
    if (tqx_torch_import(st) < 0) return PyErr_Clear(), st->trees_seen = 1;
    PyObject *has = PyObject_CallOneArg(st->tls_has_key, st->trees_key);
    const int on_thread = has ? PyObject_IsTrue(has) : -1;
    Py_XDECREF(has);
    if (on_thread == 0) return 0; /* a thread where cudagraph trees never ran */
    PyObject *containers = on_thread == 1 ? PyObject_CallOneArg(st->tls_get_obj, st->trees_key)
                                          : NULL;
    const int seen = containers && PyDict_Check(containers) ? PyDict_GET_SIZE(containers) > 0 : 1;
    if (containers == NULL) PyErr_Clear();
    Py_XDECREF(containers);
    return st->trees_seen = seen;
}

int tqx_op_may_use_graph_pool(tqx_state *st) {
    return tqx_in_compiled_op() && tqx_cudagraph_trees_seen(st);
}

static PyObject *new_tensor(tqx_state *st, PyObject *shape, tq_dtype dtype, PyObject *device,
                            int zeroed, void **data) {
    if (tqx_torch_import(st) < 0) return NULL; /* torch.zeros / empty / dtypes, once */
    /* Inside a torch.compile op the tensor may become an output of a CUDA graph that
     * cudagraph trees manage: when a later run invalidates outputs the caller still holds, they
     * free its storage through the caching allocator's own deleter and refuse any other
     * ("Expected standard deleter"), which a DLPack-made tensor has. torch.empty's is standard.
     * Until the process has cudagraph trees, compiled ops take the fast allocator as eager does
     * (~14 us per te.Linear forward on the CPU VM, ~3-4 us per allocation on the H100 host). */
    if (!zeroed && !tqx_op_may_use_graph_pool(st)) {
        PyObject *fast = exchange_empty(st, shape, dtype, device, data);
        if (fast != NULL || PyErr_Occurred()) return fast;
    }
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

/* The raw interface, looked up once: a torch built without CUDA has none (then every scratch is
 * a tensor). 0, or -1 with an exception. */
static int raw_import(tqx_state *st) {
    static const char *const names[2] = {"_cuda_cudaCachingAllocator_raw_alloc",
                                         "_cuda_cudaCachingAllocator_raw_delete"};
    if (st->raw_alloc != NULL) return 0;
    PyObject *c = PyImport_ImportModule("torch._C");
    if (c == NULL) return -1;
    PyObject *fns[2] = {NULL, NULL};
    int rc = 0;
    for (int i = 0; i < 2 && rc == 0; i++) {
        fns[i] = PyObject_GetAttrString(c, names[i]);
        if (fns[i] == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) PyErr_Clear();
        else if (fns[i] == NULL) rc = -1;
    }
    Py_DECREF(c);
    if (rc == 0 && fns[0] != NULL && fns[1] != NULL) {
        st->raw_alloc = fns[0];
        st->raw_delete = fns[1];
        return 0;
    }
    Py_XDECREF(fns[0]);
    Py_XDECREF(fns[1]);
    if (rc == 0) { /* no CUDA in this torch: remember that with None */
        st->raw_alloc = Py_NewRef(Py_None);
        st->raw_delete = Py_NewRef(Py_None);
    }
    return rc;
}

int tqx_scratch_alloc(tqx_state *st, size_t bytes, int device_index, PyObject *device,
                      void *stream, tqx_scratch *s) {
    tqx_scratch made = TQX_SCRATCH_INIT;
    if (bytes == 0) return *s = made, 0;
    /* torch's raw_alloc serves the current CUDA device: CPU memory and another device's take
     * the tensor path */
    int current = -1;
    if (device_index != TQ_DEVICE_CPU && tq_current_device(&current) != TQ_SUCCESS) current = -1;
    if (device_index != TQ_DEVICE_CPU && current == device_index) {
        if (raw_import(st) < 0) return -1;
        if (st->raw_alloc != Py_None) {
            PyObject *args[2] = {PyLong_FromSize_t(bytes), PyLong_FromVoidPtr(stream)};
            PyObject *ptr = args[0] && args[1] ? PyObject_Vectorcall(st->raw_alloc, args, 2, NULL)
                                               : NULL;
            Py_XDECREF(args[0]);
            Py_XDECREF(args[1]);
            if (ptr == NULL) return -1;
            made.raw = made.data = PyLong_AsVoidPtr(ptr);
            Py_DECREF(ptr);
            if (made.raw == NULL) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_RuntimeError, "torch's caching allocator returned no "
                                 "block for %zu bytes", bytes);
                return -1;
            }
            return *s = made, 0;
        }
    }
    made.tensor = tqx_torch_new(st, 1, (int64_t)bytes, TQ_DTYPE_UINT8, device, 0, &made.data);
    if (made.tensor == NULL) return -1;
    return *s = made, 0;
}

int tqx_workspace_alloc(tqx_state *st, size_t bytes, PyObject *x_obj, const tq_tensor *x,
                        void *stream, tqx_scratch *s, tq_tensor *workspace) {
    PyObject *device = PyObject_GetAttrString(x_obj, "device");
    if (device == NULL) return -1;
    const int failed = tqx_scratch_alloc(st, bytes, x->device, device, stream, s) < 0;
    Py_DECREF(device);
    if (failed) return -1;
    workspace->data = s->data;
    workspace->rows = 1;
    workspace->cols = workspace->ld = (int64_t)bytes;
    workspace->dtype = TQ_DTYPE_UINT8;
    workspace->device = x->device;
    return 0;
}

int tqx_pad_rows(tqx_state *st, const tq_tensor *x, void *stream, int64_t align,
                 PyObject *device, tq_tensor *xp, tqx_scratch *s) {
    const int64_t padded = (x->rows + align - 1) / align * align;
    *xp = *x;
    if (padded == x->rows) return 0;
    const size_t bytes = (size_t)padded * (size_t)x->cols * (size_t)(tq_dtype_bits(x->dtype) / 8);
    if (tqx_scratch_alloc(st, bytes, x->device, device, stream, s) < 0) return -1;
    xp->data = s->data;
    xp->rows = padded;
    xp->ld = x->cols;
    const tq_status status = tq_pad_rows(x, xp, (struct CUstream_st *)stream);
    if (status == TQ_SUCCESS) return 0;
    tqx_scratch_release(st, s);
    tqx_raise_status(st, status);
    return -1;
}

void tqx_scratch_release(tqx_state *st, tqx_scratch *s) {
    if (s->raw != NULL) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *ptr = PyLong_FromVoidPtr(s->raw);
        PyObject *r = ptr ? PyObject_CallOneArg(st->raw_delete, ptr) : NULL;
        Py_XDECREF(ptr);
        if (r == NULL) PyErr_WriteUnraisable(st->raw_delete);
        Py_XDECREF(r);
        PyErr_Restore(type, value, tb);
    }
    Py_CLEAR(s->tensor);
    s->raw = s->data = NULL;
}

PyObject *tqx_max_into(tqx_state *st, PyObject *slot, PyObject *amax) {
    PyObject *shape = PyObject_GetAttrString(slot, "shape");
    PyObject *same = shape ? PyObject_CallMethod(amax, "reshape", "(O)", shape) : NULL;
    PyObject *args = same ? PyTuple_Pack(2, slot, same) : NULL;
    PyObject *kwargs = args ? Py_BuildValue("{sO}", "out", slot) : NULL;
    PyObject *result = kwargs ? PyObject_Call(st->torch_maximum, args, kwargs) : NULL;
    Py_XDECREF(shape);
    Py_XDECREF(same);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return result;
}

void tqx_torch_clear(tqx_state *st) {
    Py_CLEAR(st->raw_alloc);
    Py_CLEAR(st->raw_delete);
    Py_CLEAR(st->torch_empty);
    Py_CLEAR(st->kw_dtype_device);
    Py_CLEAR(st->torch_zeros);
    Py_CLEAR(st->torch_mm);
    Py_CLEAR(st->torch_maximum);
    Py_CLEAR(st->torch_is_autocast_enabled);
    Py_CLEAR(st->torch_set_autocast_enabled);
    for (int i = 0; i < TQX_TORCH_DTYPE_COUNT; i++) Py_CLEAR(st->torch_dtypes[i]);
    Py_CLEAR(st->tls_has_key);
    Py_CLEAR(st->tls_get_obj);
    Py_CLEAR(st->trees_key);
    Py_CLEAR(st->gemm_workspaces);
}

int tqx_torch_traverse(tqx_state *st, visitproc visit, void *arg) {
    Py_VISIT(st->raw_alloc);
    Py_VISIT(st->raw_delete);
    Py_VISIT(st->torch_empty);
    Py_VISIT(st->kw_dtype_device);
    Py_VISIT(st->torch_zeros);
    Py_VISIT(st->torch_mm);
    Py_VISIT(st->torch_maximum);
    Py_VISIT(st->torch_is_autocast_enabled);
    Py_VISIT(st->torch_set_autocast_enabled);
    for (int i = 0; i < TQX_TORCH_DTYPE_COUNT; i++) Py_VISIT(st->torch_dtypes[i]);
    Py_VISIT(st->tls_has_key);
    Py_VISIT(st->tls_get_obj);
    Py_VISIT(st->trees_key);
    Py_VISIT(st->gemm_workspaces);
    return 0;
}

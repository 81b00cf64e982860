/* linear.c: te.Linear's host path, one C call per direction (python/tequant/linear.py holds
 * the autograd Function around them).
 *
 *   linear_forward(plan, inp, weight, bias, needs, cache, first_microbatch, x_state, w_state)
 *       -> (out, saved)
 *   linear_backward(plan, saved, dy, needs, dy_state, input_shape, bias_dtype, pending
 *                   [, after_dgrad]) -> (dx, dw, db)
 *
 * plan = (key, cfg_x, cfg_w, cfg_dy, align, flags_fprop, flags_dgrad, flags_wgrad, emulated):
 * the recipe's quantizer configs for input / weight / grad_output, the row multiple the format
 * needs (rows are zero-padded to it; zero rows add nothing to any product or amax), each GEMM's
 * tq_gemm_flags, and whether the pair is emulated (MXFP8 / NVFP4: no float16 output, so float16
 * goes through float32). needs: bit 1 dgrad (dx), bit 2 wgrad (dW), bit 4 keep x's rowwise
 * direction in saved (backward_override="dequantized"), bit 8 packed (below). cache: the
 * module's list [key, kept W] for is_first_microbatch (True: quantize and keep, False: reuse,
 * None: quantize, keep nothing). *_state: DelayedScaling's (scale, amax slot) views, or None.
 * weight may also be an already quantized W, (kept, N, K, tq dtype of W): its kept form (the
 * six members, or a packed pair) is used as it is (FSDP2's quantized all-gather,
 * python/tequant/distributed/fsdp.py); w_state and the cache are then unused. Likewise inp
 * (forward) and dy (backward) may come quantized as (six members, shape, tq dtype), their rows
 * a multiple of the format's (tensor / sequence parallelism's quantized all-gathers; a quantized
 * x may also hold its rows zero-padded to that multiple: the fused norm's codes); x_state /
 * dy_state are then unused, and a quantized dy gives no bias gradient.
 * Forward quantizes x rowwise (+ columnwise for wgrad) and W in both directions, runs fprop with
 * the bias in the epilogue, and saves the columnwise x and W for backward (TE_REFERENCE 7.3-7.5).
 * Backward quantizes dy, with the bias grad (bias_dtype None: none) from the same pass over dy
 * where the scaling allows (tq_quantize's dbias: FP32 column sums in tequant's fixed order,
 * rounded once to the bias's dtype; linear_dbias.c), runs dgrad and wgrad and, given the
 * DelayedScaling modules of an autocast (pending, passed to the module that ran first), runs
 * their backward update last.
 * A kept quantization (saved, cached) is, with bit 8 (eager te.Linear), a packed pair (buffer,
 * amax) of packed.c: one allocation per kept operand instead of one per member; without it
 * (torch.compile's ops, which return each member as a tensor, and the "dequantized" override,
 * which reads them in Python) the 6-tuple of member tensors. Backward takes either form. What
 * one call consumes (x's rowwise part, used by fprop only; dy, kept by nobody; the padded copies
 * of x and dy) lives in tqx_scratch blocks (torch_calls.c), handed back before the call returns.
 * Tests: tests/test_linear.py, tests/test_linear_module.py, tests/test_linear_delayed.py,
 * tests/test_linear_alloc.py, tests/test_linear_dbias.py.
 */
#include "module.h"


typedef struct plan {
    PyObject *key;
    tq_quant_config x, w, dy;
    int64_t align;
    uint32_t flags[3];
    int emulated;
} plan;

static int plan_from_py(tqx_state *st, PyObject *obj, plan *p) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 9) {
        PyErr_SetString(PyExc_TypeError, "linear plan must be a 9-tuple");
        return -1;
    }
    PyObject *const *it = &PyTuple_GET_ITEM(obj, 0);
    p->key = it[0];
    if (tqx_config_from_py(st, it[1], &p->x) < 0 || tqx_config_from_py(st, it[2], &p->w) < 0
        || tqx_config_from_py(st, it[3], &p->dy) < 0)
        return -1;
    p->align = PyLong_AsLongLong(it[4]);
    for (int i = 0; i < 3; i++) p->flags[i] = (uint32_t)PyLong_AsUnsignedLong(it[5 + i]);
    p->emulated = PyObject_IsTrue(it[8]);
    return PyErr_Occurred() ? -1 : 0;
}

/* One quantization, as member tensors (members) or packed (bufs or scratch, amax, q). */
typedef struct quantized {
    PyObject *members;      /* the 6-tuple, or NULL when packed */
    PyObject *bufs[2];      /* packed: bufs[i] holds the i-th part asked for ... */
    tqx_scratch scratch[2]; /* ... or scratch[i] does, when the call consumes that part */
    PyObject *amax;         /* packed, borrowed: DelayedScaling's history slot, else Py_None */
    PyObject *source;       /* borrowed: the tensor quantized (or padded from), for its device */
    tq_qtensor q;           /* packed: the members, in bufs / scratch */
    tq_tensor dbias, workspace; /* in: tq_quantize's column sums to write too (dy), or none */
} quantized;
#define QUANTIZED_INIT {NULL, {NULL, NULL}, {TQX_SCRATCH_INIT, TQX_SCRATCH_INIT}, Py_None, NULL, \
                        TQ_QTENSOR_INIT, {0}, {0}}

static void quantized_clear(tqx_state *st, quantized *z) {
    Py_CLEAR(z->members);
    for (int i = 0; i < 2; i++) {
        Py_CLEAR(z->bufs[i]);
        tqx_scratch_release(st, &z->scratch[i]);
    }
}

/* Quantizes x (the 2-D view of x_obj, or its padded copy; on `stream`) with config into *z
 * (fresh from QUANTIZED_INIT): packed into n_parts buffers holding parts[i], in scratch for the
 * parts whose bit i is set in `transient` (n_parts 0: members). state: None or the delayed
 * (scale, amax slot) pair; a delayed quantization without one needs a zeroed amax and a scale of
 * 1 made for it, which the members path does. device (index device_index): where x_obj normally
 * is; a tensor elsewhere is asked for its own. update: NULL, or the state's slot update for the
 * cast to run after itself (tq_quantize_args.update; update->done set when it ran). */
static int quantize(tqx_state *st, PyObject *x_obj, const tq_tensor *x_in, void *stream,
                    const tq_quant_config *config, uint32_t usage, PyObject *state,
                    PyObject *device, int device_index, int n_parts, const uint32_t *parts,
                    uint32_t transient, quantized *z, tqx_pending *later, tqx_update *update) {
    const tq_tensor x = *x_in;
    z->source = x_obj;
    tq_quantize_args qa = TQ_QUANTIZE_ARGS_INIT;
    qa.usage = usage;
    qa.dbias = z->dbias;
    qa.workspace = z->workspace;
    if (update != NULL) qa.update = &update->slot, qa.update_args = &update->args;
    PyObject *scale = Py_None, *amax = Py_None;
    if (state != Py_None && !PyArg_ParseTuple(state, "OO", &scale, &amax)) return -1;
    if (config->scaling == TQ_SCALING_DELAYED && (scale == Py_None || amax == Py_None)) n_parts = 0;
    PyObject *rng_owner;
    if (tqx_rng_for(st, config, x_obj, &qa, &rng_owner) < 0) {
        Py_XDECREF(rng_owner);
        return -1;
    }
    int rc;
    if (n_parts == 0) {
        z->members = tqx_quantize_members(st, x_obj, &x, stream, config, &qa, scale, amax,
                                          &z->q, later);
        rc = z->members ? 0 : -1;
    } else {
        PyObject *dev = x.device == device_index ? Py_NewRef(device)
                                                 : PyObject_GetAttrString(x_obj, "device");
        rc = dev ? tqx_quantize_packed(st, &x, stream, dev, config, &qa, scale, amax, n_parts,
                                       parts, transient, z->bufs, z->scratch, &z->q, later)
                 : -1;
        Py_XDECREF(dev);
        z->amax = amax;
    }
    Py_XDECREF(rng_owner);
    if (update != NULL) update->done = rc == 0;
    return rc;
}

/* One direction of a fresh quantization as a GEMM operand. */
static int operand(tqx_state *st, quantized *z, const tq_quant_config *config, int64_t rows,
                   int64_t cols, uint32_t usage, tqx_operand *o) {
    if (z->members) return tqx_operand_set(st, config, rows, cols, z->members, usage, o);
    tqx_operand_of(config, &z->q, usage, z->source, o);
    return 0;
}

/* The kept pair of a packed quantization's first part (new reference). */
static PyObject *packed_kept(const quantized *z) {
    return PyTuple_Pack(2, z->bufs[0], z->amax);
}

/* Members without the direction(s) backward does not read; per-tensor FP8's one scale_inv serves
 * both directions, so it stays. */
static PyObject *keep_columnwise(PyObject *m, const tq_quant_config *c) {
    const int shared = c->scaling == TQ_SCALING_DELAYED || c->scaling == TQ_SCALING_CURRENT;
    PyObject *t = PyTuple_New(6);
    if (t == NULL) return NULL;
    for (int i = 0; i < 6; i++) {
        PyObject *v = (i == 0 || (i == 1 && !shared)) ? Py_None : PyTuple_GET_ITEM(m, i);
        PyTuple_SET_ITEM(t, i, Py_NewRef(v));
    }
    return t;
}

/* The GEMM's result: rows [0, rows) of A . B^T (A has `padded` rows) in out_dtype, shaped
 * `shape`, through the core; float16 results of emulated pairs go through float32. Unpadded
 * results are written straight into a tensor of the final shape. */
static PyObject *gemm(tqx_state *st, const plan *p, tqx_operand *a, tqx_operand *b,
                      tq_dtype out_dtype, PyObject *bias, uint32_t flags, int64_t rows,
                      int64_t padded, PyObject *shape, PyObject *device) {
    PyObject *full;
    if (p->emulated && out_dtype == TQ_DTYPE_FLOAT16) {
        PyObject *f32 = tqx_gemm_run(st, a, b, Py_None, TQ_DTYPE_FLOAT32, bias, flags);
        full = f32 ? PyObject_CallMethod(f32, "to", "O", tqx_torch_dtype_of(st, TQ_DTYPE_FLOAT16))
                   : NULL;
        Py_XDECREF(f32);
    } else if (rows == padded) {
        void *data;
        PyObject *out = tqx_torch_new_shaped(st, shape, out_dtype, device, &data);
        full = out ? tqx_gemm_run(st, a, b, out, out_dtype, bias, flags) : NULL;
        Py_XDECREF(out);
        return full; /* already [..., N] */
    } else {
        full = tqx_gemm_run(st, a, b, Py_None, out_dtype, bias, flags);
    }
    /* full[:rows] (tensor indexing: cheaper than a narrow call), viewed as `shape` unless that
     * is already [rows, N] */
    PyObject *head = NULL;
    if (full != NULL && rows == padded) {
        head = Py_NewRef(full);
    } else if (full != NULL) {
        PyObject *stop = PyLong_FromLongLong((long long)rows);
        PyObject *slice = stop ? PySlice_New(NULL, stop, NULL) : NULL;
        head = slice ? PyObject_GetItem(full, slice) : NULL;
        Py_XDECREF(slice);
        Py_XDECREF(stop);
    }
    Py_XDECREF(full);
    if (head == NULL) return NULL;
    const int is_2d = PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) == 2
                      && PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 0)) == (long long)rows;
    if (PyErr_Occurred()) {
        Py_DECREF(head);
        return NULL;
    }
    if (is_2d) return head; /* the GEMM's N is shape[1] */
    PyObject *out = PyObject_CallMethod(head, "view", "O", shape);
    Py_DECREF(head);
    return out;
}

/* The weight (viewed as w, its current stream w_stream) quantized in both directions, as kept:
 * the cached one when first_microbatch is False and the cache holds this plan's on the weight's
 * device (in the member form unless packed: Python reads those), else freshly quantized (and
 * cached unless None). */
static PyObject *weight_kept(tqx_state *st, const plan *p, PyObject *weight, const tq_tensor *w,
                             void *w_stream, PyObject *cache, PyObject *first, PyObject *state,
                             long needs, PyObject *device, int device_index, tqx_pending *later) {
    const int packed = (needs & TQX_PACKED) != 0;
    if (!PyList_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "linear weight cache must be a list");
        return NULL;
    }
    if (first == Py_False && PyList_GET_SIZE(cache) == 2) {
        PyObject *kept = PyList_GET_ITEM(cache, 1);
        int same_key = PyObject_RichCompareBool(PyList_GET_ITEM(cache, 0), p->key, Py_EQ);
        if (same_key < 0) return NULL;
        const int usable = PyTuple_Check(kept) && (packed || PyTuple_GET_SIZE(kept) == 6);
        tq_tensor cached; /* item 0: the buffer or the rowwise data */
        if (same_key && usable
            && tqx_tensor_from_py(st, PyTuple_GET_ITEM(kept, 0), "cached weight", ~0u, &cached,
                                  NULL) == 0
            && w->device == cached.device)
            return Py_NewRef(kept);
        if (PyErr_Occurred()) return NULL;
    }
    static const uint32_t both = TQX_PART_ROWWISE | TQX_PART_COLUMNWISE;
    quantized z = QUANTIZED_INIT;
    if (quantize(st, weight, w, w_stream, &p->w, TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE, state,
                 device, device_index, packed ? 1 : 0, &both, 0, &z, later, NULL) < 0) {
        quantized_clear(st, &z);
        return NULL;
    }
    PyObject *kept = z.members ? Py_NewRef(z.members) : packed_kept(&z);
    quantized_clear(st, &z);
    if (kept == NULL) return NULL;
    PyObject *entry = first == Py_None ? PyList_New(0) : Py_BuildValue("[OO]", p->key, kept);
    int rc = entry ? PyList_SetSlice(cache, 0, PyList_GET_SIZE(cache), entry) : -1;
    Py_XDECREF(entry);
    if (rc < 0) {
        Py_DECREF(kept);
        return NULL;
    }
    return kept;
}

/* What backward keeps of x: its columnwise part for wgrad (all of it with TQX_KEEP_X_ROWWISE), else
 * None (new reference). */
static PyObject *x_kept(const quantized *z, const tq_quant_config *c, long needs) {
    if (z->members == NULL) /* packed: bufs[0] is the columnwise part */
        return (needs & TQX_NEED_WGRAD) ? packed_kept(z) : Py_NewRef(Py_None);
    return (needs & TQX_KEEP_X_ROWWISE) ? Py_NewRef(z->members)
           : (needs & TQX_NEED_WGRAD)   ? keep_columnwise(z->members, c)
                                    : Py_NewRef(Py_None);
}

/* The shape (a sequence) with its last dim replaced by n. */
static PyObject *shape_with_last(PyObject *shape, int64_t n) {
    PyObject *list = PySequence_List(shape);
    if (list == NULL) return NULL;
    PyObject *last = PyLong_FromLongLong(n);
    const Py_ssize_t len = PyList_GET_SIZE(list);
    int rc = last && len > 0 ? PyList_SetItem(list, len - 1, last) : -1;
    if (rc < 0 && last && len == 0) Py_DECREF(last);
    PyObject *tuple = rc == 0 ? PyList_AsTuple(list) : NULL;
    Py_DECREF(list);
    return tuple;
}

/* An operand handed in already quantized, (members, shape, tq dtype of its high-precision
 * values): *z holds the six members, *t the [prod(shape[:-1]), shape[-1]] descriptor (its data
 * is the members', never read) and *member_rows the rows its members hold (the rowwise data's
 * rows, or the columnwise data's columns): shape's rows, or more where they were zero-padded.
 * Returns the shape (borrowed), or NULL with an exception. */
static PyObject *given_operand(tqx_state *st, PyObject *obj, const char *name, tq_tensor *t,
                               quantized *z, int64_t *member_rows) {
    PyObject *members, *shape;
    int dtype;
    if (!PyArg_ParseTuple(obj, "OOi", &members, &shape, &dtype)) return NULL;
    if (!PyTuple_Check(members) || PyTuple_GET_SIZE(members) != TQX_N_MEMBERS
        || !PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) < 1 || dtype < 0 || dtype > 31
        || !(TQX_FLOAT_DTYPES & (1u << dtype))) {
        PyErr_Format(PyExc_ValueError, "a quantized %s is (six members, shape tuple, float "
                     "dtype code)", name);
        return NULL;
    }
    int64_t rows = 1;
    for (Py_ssize_t i = 0; i + 1 < PyTuple_GET_SIZE(shape); i++)
        rows *= PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    const int64_t cols = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, PyTuple_GET_SIZE(shape) - 1));
    if (PyErr_Occurred()) return NULL;
    const int rowwise = PyTuple_GET_ITEM(members, 0) != Py_None;
    PyObject *first = PyTuple_GET_ITEM(members, rowwise ? 0 : 2);
    if (tqx_tensor_from_py(st, first, name, ~0u, t, NULL) < 0) return NULL;
    /* columnwise only: data_t's columns are the rows, two a byte where E2M1 travels packed as
     * uint8 (FP8 codes travel as float8 dtypes) */
    *member_rows = rowwise ? t->rows : t->dtype == TQ_DTYPE_UINT8 ? 2 * t->cols : t->cols;
    t->rows = rows, t->cols = t->ld = cols, t->dtype = (tq_dtype)dtype;
    z->members = Py_NewRef(members);
    z->source = first;
    return shape;
}

PyObject *tqx_linear_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "linear_forward takes 9 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    plan p;
    const long needs = PyLong_AsLong(args[4]);
    if (needs == -1 && PyErr_Occurred()) return NULL;
    const int packed = (needs & TQX_PACKED) != 0;
    if (packed && (needs & TQX_KEEP_X_ROWWISE)) { /* that saved x is read as members in Python */
        PyErr_SetString(PyExc_ValueError, "linear_forward: needs bits 4 (keep x rowwise) and 8 "
                        "(packed) exclude each other");
        return NULL;
    }
    if (tqx_torch_import(st) < 0 || plan_from_py(st, args[0], &p) < 0) return NULL;
    PyObject *inp = args[1], *weight = args[2], *bias = args[3];
    tq_tensor w = {0};
    tqx_tensor_info w_info = {0};
    PyObject *w_given = NULL; /* an already quantized W: its kept form */
    PyObject *w_dense = NULL; /* a strided W's contiguous copy */
    if (PyTuple_Check(weight)) {
        long long rows, cols;
        int dtype;
        if (!PyArg_ParseTuple(weight, "OLLi", &w_given, &rows, &cols, &dtype)) return NULL;
        if (dtype < 0 || dtype > 31 || !(TQX_FLOAT_DTYPES & (1u << dtype)) || rows <= 0
            || cols <= 0) {
            PyErr_Format(PyExc_ValueError, "a quantized weight (kept, N, K, dtype) needs N, K > 0 "
                         "and a float32/bfloat16/float16 dtype code; got %lld, %lld, %d", rows,
                         cols, dtype);
            return NULL;
        }
        w.rows = rows, w.cols = w.ld = cols, w.dtype = (tq_dtype)dtype;
    } else if (tqx_tensor_from_py(st, weight, "weight", TQX_FLOAT_DTYPES, &w, &w_info) < 0) {
        /* a strided W (a transposed Parameter): quantized from its contiguous copy */
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
        PyErr_Clear();
        if ((w_dense = PyObject_CallMethod(weight, "contiguous", NULL)) == NULL) return NULL;
        if (tqx_tensor_from_py(st, w_dense, "weight", TQX_FLOAT_DTYPES, &w, &w_info) < 0) {
            Py_DECREF(w_dense);
            return NULL;
        }
        weight = w_dense;
    }
    const int64_t n = w.rows, k = w.cols;
    PyObject *device = NULL, *qw = NULL, *shape = NULL, *out = NULL, *x_shape = NULL;
    PyObject *result = NULL;
    quantized qx = QUANTIZED_INIT;
    tqx_scratch pad = TQX_SCRATCH_INIT;
    tq_tensor x, xp;
    tqx_tensor_info x_info = {0};
    /* x may come quantized too, (members, shape, dtype): tensor parallelism's all-gathered
     * input (python/tequant/distributed/tensor_parallel.py), its rows the format's multiple, or
     * the fused norm's codes (python/tequant/_norm_fn.py), whose members hold the rows
     * zero-padded to that multiple as te.Linear pads x (zero codes), so backward pads dy alike */
    if (PyTuple_Check(inp)) {
        int64_t member_rows;
        if ((x_shape = given_operand(st, inp, "input", &x, &qx, &member_rows)) == NULL) goto done;
        Py_INCREF(x_shape);
        const int64_t want = (x.rows + p.align - 1) / p.align * p.align;
        if (member_rows != x.rows && member_rows != want) {
            PyErr_Format(PyExc_ValueError, "a quantized input of %lld rows needs members of "
                         "%lld rows (or %lld: zero-padded to the format's multiple %lld); got "
                         "%lld", (long long)x.rows, (long long)x.rows, (long long)want,
                         (long long)p.align, (long long)member_rows);
            goto done;
        }
        if (member_rows % p.align) {
            PyErr_Format(PyExc_ValueError, "a quantized input needs rows a multiple of %lld; got "
                         "%lld", (long long)p.align, (long long)member_rows);
            goto done;
        }
        device = PyObject_GetAttrString(qx.source, "device");
        xp = x;
        xp.rows = member_rows;
    } else {
        x_shape = PyObject_GetAttrString(inp, "shape");
        device = PyObject_GetAttrString(inp, "device");
        if (x_shape == NULL || device == NULL
            || tqx_tensor_from_py(st, inp, "input", TQX_FLOAT_DTYPES, &x, &x_info) < 0)
            goto done;
    }
    if (device == NULL) goto done;
    if (x.cols != k) {
        PyErr_Format(PyExc_ValueError, "input has %lld features in its last dim; the weight "
                     "takes %lld", (long long)x.cols, (long long)k);
        goto done;
    }
    /* FP8 (per-tensor, block) quantizes x and a W not kept from before in one launch where it can
     * (tq_quantize_pair): both are recorded, then run together before the GEMM */
    tqx_pending later[2] = {TQX_PENDING_INIT, TQX_PENDING_INIT};
    const int pair = qx.members == NULL && w_given == NULL && x_info.stream == w_info.stream
                     && p.x.scaling == p.w.scaling
                     && (p.x.scaling == TQ_SCALING_CURRENT || p.x.scaling == TQ_SCALING_DELAYED
                         || p.x.scaling == TQ_SCALING_BLOCK);
    if (qx.members == NULL) {
        if (tqx_pad_rows(st, &x, x_info.stream, p.align, device, &xp, &pad) < 0) goto done;
        const uint32_t x_usage =
            TQ_USAGE_ROWWISE | ((needs & TQX_NEED_WGRAD) ? TQ_USAGE_COLUMNWISE : 0);
        /* packed x: with wgrad, the columnwise part (kept) apart from the rowwise one, which
         * fprop consumes in this call (scratch) */
        static const uint32_t x_parts[2] = {TQX_PART_COLUMNWISE, TQX_PART_ROWWISE};
        const int x_n_parts = !packed ? 0 : (needs & TQX_NEED_WGRAD) ? 2 : 1;
        if (quantize(st, inp, &xp, x_info.stream, &p.x, x_usage, args[7], device, x.device,
                     x_n_parts, x_n_parts == 2 ? x_parts : x_parts + 1,
                     x_n_parts == 2 ? 2u : 1u, &qx, pair ? &later[0] : NULL, NULL) < 0)
            goto done;
    }
    const int64_t padded = xp.rows;
    if (w_given != NULL) {
        qw = Py_NewRef(w_given);
        w.device = x.device;
    } else if ((qw = weight_kept(st, &p, weight, &w, w_info.stream, args[5], args[6], args[8],
                                 needs, device, x.device, pair ? &later[1] : NULL)) == NULL) {
        goto done;
    }
    if (tqx_run_pending(st, &later[0], &later[1]) < 0) goto done;
    tqx_operand a, b;
    if (operand(st, &qx, &p.x, padded, k, TQ_USAGE_ROWWISE, &a) < 0
        || tqx_operand_from_kept(st, &p.w, n, k, qw, TQX_PART_ROWWISE | TQX_PART_COLUMNWISE,
                                 TQ_USAGE_ROWWISE, &b) < 0)
        goto done;
    if ((shape = shape_with_last(x_shape, n)) == NULL
        || (out = gemm(st, &p, &a, &b, x.dtype, bias, p.flags[0], x.rows, padded, shape,
                       device)) == NULL)
        goto done;
    /* saved: (x kept (its columnwise part, or all of it) or None, W kept, rows, padded rows, N,
     * K, dtype of x, dtype of W) */
    PyObject *x_saved = x_kept(&qx, &p.x, needs);
    if (x_saved == NULL) goto done;
    PyObject *saved = Py_BuildValue("(NOLLLLii)", x_saved, qw, (long long)x.rows,
                                    (long long)padded, (long long)n, (long long)k, (int)x.dtype,
                                    (int)w.dtype);
    if (saved != NULL) result = PyTuple_Pack(2, out, saved);
    Py_XDECREF(saved);
done:
    Py_XDECREF(device);
    Py_XDECREF(x_shape);
    tqx_scratch_release(st, &pad);
    quantized_clear(st, &qx);
    Py_XDECREF(qw);
    Py_XDECREF(shape);
    Py_XDECREF(out);
    Py_XDECREF(w_dense);
    return result;
}

PyObject *tqx_linear_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    return tqx_linear_backward_updating(module, args, nargs, NULL);
}

PyObject *tqx_linear_backward_updating(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                       tqx_update *update) {
    if (nargs != 8 && nargs != 9) {
        PyErr_Format(PyExc_TypeError, "linear_backward takes 8 or 9 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    /* after_dgrad(dx), called once the dgrad GEMM is queued and before wgrad's, returns what
     * stands for dx in the result: tensor parallelism starts dx's reduce-scatter there, so the
     * collective runs beside the wgrad GEMM (tensor_parallel.py) */
    PyObject *after_dgrad = nargs == 9 ? args[8] : Py_None;
    if (after_dgrad != Py_None && !PyCallable_Check(after_dgrad)) {
        PyErr_SetString(PyExc_TypeError, "linear_backward: after_dgrad must be callable or None");
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    plan p;
    PyObject *qx, *qw;
    long long rows, padded, n, k;
    int x_dtype, w_dtype;
    const long needs = PyLong_AsLong(args[3]);
    if (needs == -1 && PyErr_Occurred()) return NULL;
    if (tqx_torch_import(st) < 0 || plan_from_py(st, args[0], &p) < 0
        || !PyArg_ParseTuple(args[1], "OOLLLLii", &qx, &qw, &rows, &padded, &n, &k, &x_dtype,
                             &w_dtype))
        return NULL;
    PyObject *dy = args[2], *inp_shape = args[5], *bias_dtype = args[6], *pending = args[7];
    PyObject *device = NULL;
    PyObject *dx = NULL, *dw = NULL, *db = NULL, *dw_shape = NULL;
    PyObject *result = NULL;
    quantized qdy = QUANTIZED_INIT;
    tqx_scratch pad = TQX_SCRATCH_INIT, db_workspace = TQX_SCRATCH_INIT;
    tq_tensor d, dyp;
    tqx_tensor_info dy_info;
    /* dy may come quantized, (members, shape, dtype): sequence parallelism's all-gathered
     * grad_output; its bias gradient is then the caller's */
    const int dy_given = PyTuple_Check(dy);
    if (dy_given) {
        int64_t member_rows;
        if (given_operand(st, dy, "grad_output", &d, &qdy, &member_rows) == NULL) goto done;
        if (member_rows != d.rows) {
            PyErr_Format(PyExc_ValueError, "a quantized grad_output of %lld rows has members of "
                         "%lld rows", (long long)d.rows, (long long)member_rows);
            goto done;
        }
        if (bias_dtype != Py_None) {
            PyErr_SetString(PyExc_ValueError, "a quantized grad_output gives no bias gradient: "
                            "pass bias_dtype None");
            goto done;
        }
    }
    device = PyObject_GetAttrString(dy_given ? qdy.source : dy, "device");
    if (device == NULL
        || (!dy_given
            && tqx_tensor_from_py(st, dy, "grad_output", TQX_FLOAT_DTYPES, &d, &dy_info) < 0))
        goto done;
    if (d.rows != rows || d.cols != n || (dy_given && rows != padded)) {
        PyErr_Format(PyExc_ValueError, "grad_output is [%lld, %lld] as rows; the forward made "
                     "[%lld, %lld]", (long long)d.rows, (long long)d.cols, rows, n);
        goto done;
    }
    const uint32_t usage = ((needs & TQX_NEED_DGRAD) ? TQ_USAGE_ROWWISE : 0)
                           | ((needs & TQX_NEED_WGRAD) ? TQ_USAGE_COLUMNWISE : 0);
    /* dy is consumed by this call's GEMMs: scratch, one part, or two for both directions of over
     * 16M elements (dgrad's rowwise part released before dW is allocated: the backward's peak);
     * dbias comes from the pass that quantizes dy, or one of its own when no GEMM runs */
    const uint32_t dy_parts[2] = {TQX_PART_ROWWISE, TQX_PART_COLUMNWISE};
    const int dy_split = usage == (TQ_USAGE_ROWWISE | TQ_USAGE_COLUMNWISE)
                         && (int64_t)padded * n > ((int64_t)1 << 24);
    if (!dy_given
        && (tqx_pad_rows(st, &d, dy_info.stream, p.align, device, &dyp, &pad) < 0
            || (bias_dtype != Py_None
                && (db = tqx_linear_dbias_new(st, bias_dtype, &p.dy, dy, &dyp, dy_info.stream,
                                              device, &db_workspace, &qdy.dbias,
                                              &qdy.workspace)) == NULL)
            || (usage ? quantize(st, dy, &dyp, dy_info.stream, &p.dy, usage, args[4], device,
                                 d.device, dy_split ? 2 : 1, dy_split ? dy_parts : &usage,
                                 dy_split ? 3u : 1u, &qdy, NULL, update)
                : db  ? tqx_linear_dbias_alone(st, &dyp, dy_info.stream, &qdy.dbias,
                                               &qdy.workspace)
                      : 0) < 0))
        goto done;
    if (needs & TQX_NEED_DGRAD) { /* dx = dy . W: dy rowwise [M, N], W columnwise [K, N] */
        tqx_operand a, b;
        if (operand(st, &qdy, &p.dy, padded, n, TQ_USAGE_ROWWISE, &a) < 0
            || tqx_operand_from_kept(st, &p.w, n, k, qw, TQX_PART_ROWWISE | TQX_PART_COLUMNWISE,
                                     TQ_USAGE_COLUMNWISE, &b) < 0
            || (dx = gemm(st, &p, &a, &b, (tq_dtype)x_dtype, Py_None, p.flags[1], rows, padded,
                          inp_shape, device)) == NULL)
            goto done;
        if (after_dgrad != Py_None) {
            Py_SETREF(dx, PyObject_CallOneArg(after_dgrad, dx));
            if (dx == NULL) goto done;
        }
        if (dy_split) tqx_scratch_release(st, &qdy.scratch[0]); /* queued: stream-ordered reuse */
    }
    if ((needs & TQX_NEED_WGRAD) && padded == 0) { /* no tokens: nothing to contract, dW = 0 */
        void *data;
        if ((dw = tqx_torch_new(st, n, k, (tq_dtype)w_dtype, device, 1, &data)) == NULL)
            goto done;
    } else if (needs & TQX_NEED_WGRAD) { /* dW = dy^T . x: dy col. [N, M], x col. [K, M] */
        tqx_operand a, b;
        if (operand(st, &qdy, &p.dy, padded, n, TQ_USAGE_COLUMNWISE, &a) < 0
            || tqx_operand_from_kept(st, &p.x, padded, k, qx, TQX_PART_COLUMNWISE,
                                     TQ_USAGE_COLUMNWISE, &b) < 0
            || (dw_shape = Py_BuildValue("(LL)", n, k)) == NULL
            || (dw = gemm(st, &p, &a, &b, (tq_dtype)w_dtype, Py_None, p.flags[2], n, n,
                          dw_shape, device)) == NULL)
            goto done;
    }
    if (pending != Py_None) { /* last in backward: the DelayedScaling backward update */
        PyObject *r = st->delayed_backward_update
                          ? PyObject_CallOneArg(st->delayed_backward_update, pending) : NULL;
        if (r == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "tequant.delayed is not imported");
            goto done;
        }
        Py_DECREF(r);
    }
    result = PyTuple_Pack(3, dx ? dx : Py_None, dw ? dw : Py_None, db ? db : Py_None);
done:
    Py_XDECREF(device);
    Py_XDECREF(db);
    Py_XDECREF(dw_shape);
    tqx_scratch_release(st, &pad);
    tqx_scratch_release(st, &db_workspace);
    quantized_clear(st, &qdy);
    Py_XDECREF(dx);
    Py_XDECREF(dw);
    return result;
}

PyMethodDef tqx_linear_methods[] = {
    {"linear_forward", (PyCFunction)(void (*)(void))tqx_linear_forward, METH_FASTCALL,
     "linear_forward(plan, inp, weight, bias, needs, cache, first_microbatch, x_state, w_state)"
     " -> (out, saved)\n\nte.Linear's quantized forward; see csrc/ext/linear.c."},
    {"linear_backward", (PyCFunction)(void (*)(void))tqx_linear_backward, METH_FASTCALL,
     "linear_backward(plan, saved, dy, needs, dy_state, input_shape, bias_dtype, pending"
     "[, after_dgrad]) -> "
     "(dx, dw, db)\n\nte.Linear's quantized backward; see csrc/ext/linear.c."},
    {NULL, NULL, 0, NULL}};

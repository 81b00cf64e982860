/* module.h: what the files of the tequant._C extension share: the module state, the recipe
 * table entry, and each file's entry points. Plain C on CPython's C API (no pybind11).
 *
 * Everything Python-visible that the module owns lives in tqx_state (multi-phase init, one state
 * per module object), never in static PyObject*. Tests: tests/test_*.py.
 */
#ifndef TEQUANT_EXT_MODULE_H_
#define TEQUANT_EXT_MODULE_H_

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "dlpack_abi.h"
#include "tequant/tequant.h"

/* Tensor roles of a Linear; the registry holds one quantizer config per (recipe, role). */
typedef enum tqx_role {
    TQX_ROLE_INPUT = 0,
    TQX_ROLE_WEIGHT = 1,
    TQX_ROLE_OUTPUT = 2,
    TQX_ROLE_GRAD_OUTPUT = 3,
    TQX_ROLE_GRAD_INPUT = 4,
    TQX_ROLE_COUNT = 5
} tqx_role;

typedef enum tqx_recipe_kind {
    TQX_RECIPE_DELAYED = 0,
    TQX_RECIPE_CURRENT = 1,
    TQX_RECIPE_BLOCK = 2,
    TQX_RECIPE_MXFP8 = 3,
    TQX_RECIPE_NVFP4 = 4,
    TQX_RECIPE_CUSTOM = 5,
    TQX_RECIPE_KIND_COUNT = 6
} tqx_recipe_kind;

typedef enum tqx_mode {
    TQX_MODE_NATIVE = 0,
    TQX_MODE_EMULATED = 1,
    TQX_MODE_CPU_REFERENCE = 2,
    TQX_MODE_UNSUPPORTED = 3
} tqx_mode;

/* te.Linear's `needs` bits (linear.c, linear_ops.c), exported to Python as _C.LINEAR_NEED_DGRAD,
 * _C.LINEAR_NEED_WGRAD, _C.LINEAR_KEEP_X_ROWWISE, _C.LINEAR_PACKED and _C.LINEAR_DEFER_UPDATE. */
typedef enum tqx_linear_needs {
    TQX_NEED_DGRAD = 1,
    TQX_NEED_WGRAD = 2,
    TQX_KEEP_X_ROWWISE = 4, /* backward_override="dequantized" reads the rowwise x */
    TQX_PACKED = 8,         /* saved and the cache hold packed (buffer, amax) pairs */
    /* the compiled in-place backward ops only: dy's amax goes into the module's history, whose
     * update waits for the end of the backward pass (an amax all-reduce first; linear.c never
     * sees this bit) */
    TQX_DEFER_UPDATE = 16
} tqx_linear_needs;

typedef enum tqx_gemm { TQX_GEMM_FPROP = 0, TQX_GEMM_DGRAD = 1, TQX_GEMM_WGRAD = 2 } tqx_gemm;

/* Whether a recipe can run where autocast is entered; computed once, see capability.c. */
typedef enum tqx_enter_check {
    TQX_ENTER_UNKNOWN = 0,
    TQX_ENTER_OK = 1,
    TQX_ENTER_REFUSED = 2,
    TQX_ENTER_PER_DEVICE = 3 /* devices differ: check the current one at each enter */
} tqx_enter_check;

/* One distinct recipe (by equality). Its index in tqx_state.recipes is the recipe key. */
typedef struct tqx_recipe_entry {
    PyObject *recipe; /* strong: the first equal recipe seen */
    tqx_recipe_kind kind;
    tq_quant_config roles[TQX_ROLE_COUNT];
    int split_accumulator[3]; /* per tqx_gemm: 1 = full FP32 accumulation */
    tqx_enter_check enter_check;
    PyObject *refusal; /* str: why the recipe cannot run here (TQX_ENTER_REFUSED) */
} tqx_recipe_entry;

/* torch dtypes the extension allocates with (quantize.c). */
typedef enum tqx_torch_dtype {
    TQX_TORCH_FLOAT32 = 0,
    TQX_TORCH_UINT8 = 1,
    TQX_TORCH_FLOAT8_E4M3 = 2,
    TQX_TORCH_FLOAT8_E5M2 = 3,
    TQX_TORCH_FLOAT8_E8M0 = 4,
    TQX_TORCH_BFLOAT16 = 5,
    TQX_TORCH_FLOAT16 = 6,
    TQX_TORCH_DTYPE_COUNT = 7
} tqx_torch_dtype;

#define TQX_ID_CACHE_SIZE 8
#define TQX_LINEAR_MODULE_SLOTS 48
#define TQX_MAX_DEVICES 64

typedef struct tqx_state {
    /* types and exceptions */
    PyTypeObject *autocast_type;
    PyTypeObject *quantizer_config_type;
    PyTypeObject *execution_mode_type; /* structseq (mode, reason) */
    PyObject *cuda_error;              /* tequant.CudaError, a RuntimeError */
    /* per-thread / per-context autocast state: the innermost active autocast, or None */
    PyObject *context_var;
    /* recipes, imported lazily from tequant.recipe (it imports this module) */
    PyObject *recipe_base;                           /* tequant.recipe.Recipe */
    PyObject *recipe_classes[TQX_RECIPE_KIND_COUNT]; /* indexed by tqx_recipe_kind */
    PyObject *default_recipe;                        /* Float8CurrentScaling() */
    /* the recipe table: key -> entry, recipe -> key */
    PyObject *key_of_recipe; /* dict: recipe -> int key */
    tqx_recipe_entry *recipes;
    Py_ssize_t n_recipes, cap_recipes;
    PyObject *id_cache_recipe[TQX_ID_CACHE_SIZE]; /* strong refs: identity fast path */
    Py_ssize_t id_cache_key[TQX_ID_CACHE_SIZE];
    int id_cache_next;
    /* devices, queried once */
    int device_count; /* -1 until queried */
    int cc[TQX_MAX_DEVICES]; /* 10 * major + minor */
    int devices_alike;
    int devices_simulated; /* test hook _set_device_facts: current device is 0, no CUDA calls */
    size_t cublaslt_version;
    /* DLPack exchange, cached per tensor type */
    PyTypeObject *dlpack_type; /* strong */
    const DLPackExchangeAPI *dlpack_api;
    /* torch_calls.c: the torch.device last allocated on (strong) and its DLPack device */
    PyObject *alloc_device;
    DLDevice alloc_dl_device;
    /* torch functions and dtypes (torch_calls.c), imported on first use */
    PyObject *torch_empty, *torch_zeros, *torch_mm, *torch_maximum;
    PyObject *kw_dtype_device; /* ("dtype", "device"): the keyword names of torch.empty calls */
    PyObject *torch_is_autocast_enabled, *torch_set_autocast_enabled;
    PyObject *torch_dtypes[TQX_TORCH_DTYPE_COUNT];
    /* torch._C._is_key_in_tls / _get_obj_in_tls and "tree_manager_containers": where cudagraph
     * trees keep their per-thread containers (tqx_cudagraph_trees_seen); trees_seen: sticky */
    PyObject *tls_has_key, *tls_get_obj, *trees_key;
    int trees_seen;
    /* torch's CUDA caching allocator, raw (torch._C._cuda_cudaCachingAllocator_raw_alloc /
     * _raw_delete), for memory that lives within one call; NULL without CUDA torch */
    PyObject *raw_alloc, *raw_delete;
    /* state.c: called with the root frame's DelayedScaling modules at the outermost exit, and
     * (backward) at the end of the backward of the module that ran first */
    PyObject *delayed_update, *delayed_backward_update;
    /* quantize.c (tqx_rng_for): tequant._rng.rng_state, the stochastic-rounding rng source */
    PyObject *rng_state;
    /* gemm.c: the cuBLASLt workspace per (device, stream), a dict of uint8 tensors, and the
     * last one looked up (a view of a tensor the dict holds; data NULL: none yet) */
    PyObject *gemm_workspaces;
    tq_tensor gemm_ws_last;
    int gemm_ws_last_device;
    void *gemm_ws_last_stream;
    /* linear_ops.c: recipe id (str) -> linear plan tuple, filled through linear_plan_of (set by
     * tequant._compile_linear) on a miss */
    PyObject *linear_plans, *linear_plan_of;
    PyObject *op_configs, *op_config_of; /* functional_ops.c: (recipe_id, role) -> config */
    /* linear_delayed.c: the in-place ops' DelayedScaling states kept per history buffer */
    PyObject *delayed_states;
    /* linear_module.c: the torch objects te.Linear.forward's C call uses (handed over by
     * linear.py's _C._linear_module_setup; NULL until then) and the names it looks up */
    PyObject *linear_module[TQX_LINEAR_MODULE_SLOTS];
    /* interned keyword names for the autocast constructor */
    PyObject *str_enabled, *str_calibrating, *str_recipe, *str_amax_reduction_group;
} tqx_state;

/* errors.c: the one place where tq_status becomes a Python exception. Returns NULL. */
PyObject *tqx_raise_status(tqx_state *st, tq_status status);
int tqx_errors_init(PyObject *module, tqx_state *st);

/* registry.c: recipe keys and the quantizer registry. */
Py_ssize_t tqx_recipe_key(tqx_state *st, PyObject *recipe); /* -1 with an exception */
int tqx_registry_init(PyObject *module, tqx_state *st);
void tqx_registry_clear(tqx_state *st);
int tqx_registry_traverse(tqx_state *st, visitproc visit, void *arg);
extern PyMethodDef tqx_registry_methods[];
/* A tequant.QuantizerConfig -> its config; -1 with TypeError for anything else. */
int tqx_quantizer_config_get(tqx_state *st, PyObject *obj, tq_quant_config *out);

/* recipe.c: recipe object -> kind and per-role quantizer configs. */
int tqx_recipe_import(tqx_state *st); /* imports tequant.recipe once; -1 with an exception */
int tqx_recipe_parse(tqx_state *st, PyObject *recipe, tqx_recipe_entry *entry);
extern const char *const tqx_role_names[TQX_ROLE_COUNT];

/* capability.c: which execution mode a recipe gets on a device, and the enter check. */
tqx_mode tqx_execution_mode(tqx_state *st, tqx_recipe_kind kind, int device, PyObject **reason);
int tqx_check_enter(tqx_state *st, tqx_recipe_entry *entry); /* -1 with RuntimeError */
int tqx_capability_init(PyObject *module, tqx_state *st);
extern PyMethodDef tqx_capability_methods[];

/* tensor_view.c: torch.Tensor -> tq_tensor through the DLPack C exchange API. */
typedef struct tqx_tensor_info {
    int ndim;
    int64_t shape[8];
    void *stream; /* the framework's current CUDA stream for a CUDA tensor, else NULL */
} tqx_tensor_info;
/* dtype_mask of the high-precision tensors tequant quantizes and writes: fp32, bf16, fp16. */
#define TQX_FLOAT_DTYPES \
    ((1u << TQ_DTYPE_FLOAT32) | (1u << TQ_DTYPE_BFLOAT16) | (1u << TQ_DTYPE_FLOAT16))
int tqx_tensor_from_py(tqx_state *st, PyObject *obj, const char *name, uint32_t dtype_mask,
                       tq_tensor *out, tqx_tensor_info *info);
/* An optional tensor keyword: None (or absent, obj NULL) leaves out empty (data NULL: not given). */
int tqx_optional_tensor(tqx_state *st, PyObject *obj, const char *name, uint32_t dtype_mask,
                        tq_tensor *out);
/* A keyword a call needs: 0 when given, else -1 with "fn() missing required keyword argument". */
int tqx_required(PyObject *obj, const char *fn, const char *name);
extern PyMethodDef tqx_tensor_view_methods[];

/* ops.c */
extern PyMethodDef tqx_ops_methods[];
/* ops.c: 2-D one-byte codes [rows, cols] transposed into a new [cols, rows] tensor (tq_transpose
 * on their current stream; new reference, or NULL with an exception) */
PyObject *tqx_transposed(tqx_state *st, PyObject *codes);

/* codec.c: _C._codec, the elementwise codecs for tests */
extern PyMethodDef tqx_codec_methods[];

/* fused_out.c: arguments and outputs of the allocating fused calls. *out = the truth of a
 * positional flag; -1 with an exception. */
int tqx_flag_arg(PyObject *obj, int *out);
/* A new [rows, cols] tensor (vector: 1-D of
 * rows * cols) of dtype on `device` (a torch.device; index device_index), torch.zeros when
 * zeroed (matrices only), appended to the list outs and described in *t. -1 with an
 * exception. */
int tqx_new_output(tqx_state *st, PyObject *outs, int64_t rows, int64_t cols, int vector,
                   tq_dtype dtype, PyObject *device, int device_index, int zeroed, tq_tensor *t);
/* te.Linear's rowwise operand of an [m, n] output quantized with config (DELAYED / CURRENT),
 * appended to outs: codes [padded, n] (rows past m zero; *codes describes the first m rows),
 * scale_inv, and the amax: `amax` itself (the caller's DelayedScaling slot) or, for None, a new
 * zero [1, 1]; then, where codes_t is not NULL, wgrad's columnwise codes [n, padded] (columns
 * past m zero; *codes_t describes the first m). -1 with an exception. */
int tqx_fused_fp8_outputs(tqx_state *st, PyObject *outs, const tq_quant_config *config,
                          int64_t padded, int64_t m, int64_t n, PyObject *device,
                          int device_index, PyObject *amax, tq_tensor *codes,
                          tq_tensor *scale_inv, tq_tensor *amax_t, tq_tensor *codes_t);

/* norm.c: _C._norm_forward, _C._norm_backward (the fused normalization kernels) and the
 * allocating _C._norm_fwd / _C._norm_bwd, which fused_ops.c's op kernels call too */
extern PyMethodDef tqx_norm_methods[];
PyObject *tqx_norm_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *tqx_norm_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* act.c: _C._act_forward, _C._act_backward (the fused activation kernels) and the allocating
 * _C._act_fwd / _C._act_bwd, as norm.c's */
extern PyMethodDef tqx_act_methods[];
PyObject *tqx_act_backward(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *tqx_act_fwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *tqx_act_bwd(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* fused_ops.c / given_ops.c: the kernels of the norm's and activation's tequant:: ops, and of
 * te.Linear's on a given operand */
extern PyMethodDef tqx_fused_ops_methods[];
extern PyMethodDef tqx_given_ops_methods[];
/* dy_given.c: te.Linear's backward on a grad_output given quantized, (dx or None, dW or None)
 * (new reference, or NULL with an exception) */
extern PyMethodDef tqx_dy_given_methods[];
PyObject *tqx_given_dy_backward(PyObject *module, PyObject *c_args, PyObject *saved,
                               PyObject *dy_q, long needs, PyObject *inp_shape, PyObject *pending,
                               int blocks);

/* torch_calls.c: torch functions the extension calls (allocation, dtypes), imported once. */
int tqx_torch_import(tqx_state *st); /* -1 with an exception */
PyObject *tqx_torch_dtype_of(tqx_state *st, tq_dtype d); /* borrowed; packed E2M1 -> uint8 */
tq_dtype tqx_dtype_of_torch(tqx_state *st, PyObject *dtype); /* TQ_DTYPE_COUNT_ if not a float */
/* slot = max(slot, amax) in place (torch.maximum: a one-element amax into a DelayedScaling
 * history slot, on their device); the result (new reference), or NULL with an exception.
 * Needs tqx_torch_import. */
PyObject *tqx_max_into(tqx_state *st, PyObject *slot, PyObject *amax);
/* A new [rows, cols] tensor (cols in elements; packed E2M1 counts codes) of dtype on `device`
 * (a torch.device), torch.zeros when zeroed; its data pointer goes to *data. */
PyObject *tqx_torch_new(tqx_state *st, int64_t rows, int64_t cols, tq_dtype dtype,
                        PyObject *device, int zeroed, void **data);
/* The same with any shape (a tuple or torch.Size), uninitialized. */
PyObject *tqx_torch_new_shaped(tqx_state *st, PyObject *shape, tq_dtype dtype, PyObject *device,
                               void **data);
/* Device memory that lives within one C call (a padded copy, a quantized operand the call
 * consumes, an emulated GEMM's scratch). On CUDA, when the memory's device is the current one,
 * a raw block of torch's caching allocator (~1 us of host time against ~6 us for a torch.empty
 * from C, docs/results/NOTES.md); else a uint8 torch tensor. Either way the block goes back to
 * the allocator's pool for `stream`, so its reuse is ordered after the kernels queued on that
 * stream, and during a CUDA-graph capture it comes from the graph's pool, as a tensor would. */
typedef struct tqx_scratch {
    void *data;
    void *raw;        /* the raw block to hand back, or NULL */
    PyObject *tensor; /* or the tensor that holds data, or NULL */
} tqx_scratch;
#define TQX_SCRATCH_INIT {NULL, NULL, NULL}
/* bytes of scratch on `device` (its index device_index; a torch.device) for use on `stream`
 * (the current stream of that device). -1 with an exception, s untouched then. */
int tqx_scratch_alloc(tqx_state *st, size_t bytes, int device_index, PyObject *device,
                      void *stream, tqx_scratch *s);
/* bytes of scratch on the device of x_obj (viewed as x; stream: its current stream), described
 * in *workspace as UINT8 [1, bytes] (a fused backward's column partials). -1 with an exception. */
int tqx_workspace_alloc(tqx_state *st, size_t bytes, PyObject *x_obj, const tq_tensor *x,
                        void *stream, tqx_scratch *s, tq_tensor *workspace);
/* Hands s back (a no-op for an empty one) and empties it; keeps a pending exception. */
void tqx_scratch_release(tqx_state *st, tqx_scratch *s);
/* x [rows, cols] as *xp [padded, cols], `padded` the next multiple of `align` rows: x itself
 * when aligned, else a copy in scratch *s (released by the caller; te.Linear's x and dy,
 * linear.c), zero-filled past x by the core (one launch on x's stream). -1 with an exception. */
int tqx_pad_rows(tqx_state *st, const tq_tensor *x, void *stream, int64_t align,
                 PyObject *device, tq_tensor *xp, tqx_scratch *s);
/* Turns torch.autocast off for `device_type` ("cpu"); *was_on says whether to restore it with
 * tqx_autocast_restore. The CPU GEMM's float32 torch.mm must not be recast to bf16 by AMP. */
int tqx_autocast_off(tqx_state *st, const char *device_type, int *was_on);
int tqx_autocast_restore(tqx_state *st, const char *device_type, int was_on);
void tqx_torch_clear(tqx_state *st);
int tqx_torch_traverse(tqx_state *st, visitproc visit, void *arg);

/* The members of a quantized tensor by index, in the order of the 6-tuples the extension
 * exchanges: data, scale_inv, data_t, scale_inv_t, amax, amax_t. */
#define TQX_N_MEMBERS 6
static inline tq_tensor *tqx_member(tq_qtensor *q, int i) {
    tq_tensor *m[TQX_N_MEMBERS] = {&q->data, &q->scale_inv, &q->data_t, &q->scale_inv_t,
                                   &q->amax, &q->amax_t};
    return m[i];
}
/* Whether tq_quantize_layout uses the member (an unused one has zero dims and ld). */
static inline int tqx_member_used(const tq_tensor *t) {
    return t->rows != 0 || t->cols != 0 || t->ld != 0;
}

/* quantize.c */
extern PyMethodDef tqx_quantize_methods[];
/* _C._quantize / _C._dequantize (functional_ops.c's kernels call them too) */
PyObject *tqx_quantize(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *tqx_dequantize(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* A QuantizerConfig object that quantizes in the core -> its config; -1 with an exception. */
int tqx_config_from_py(tqx_state *st, PyObject *obj, tq_quant_config *out);
/* A quantization laid out and allocated whose kernel is still to run: tqx_quantize_members /
 * tqx_quantize_packed given `later` (not NULL) record it there instead of running it (all but
 * stochastic rounding and DelayedScaling without its state's scale, which run at once), and
 * tqx_run_pending runs what was recorded, two of them through tq_quantize_pair (te.Linear's x
 * and W: one launch under FP8 per-tensor and block scaling). The tensors q and a DelayedScaling scale
 * point into must live until it runs. */
typedef struct tqx_pending {
    tq_tensor x;
    tq_quant_config config;
    tq_quantize_args args;
    tq_qtensor q;
    void *stream;
    int set;
} tqx_pending;
#define TQX_PENDING_INIT {{0}, {0}, {0}, {0}, NULL, 0}
/* Runs first and second where set (second: with first, on first's stream), with the GIL
 * released; both cleared. -1 with an exception. */
int tqx_run_pending(tqx_state *st, tqx_pending *first, tqx_pending *second);
/* Quantizes x_obj (viewed as x; its current stream) with config into new torch members, laid out
 * in q: returns the 6-tuple (data, scale_inv, data_t, scale_inv_t, amax, amax_t), None where
 * unused. qargs: usage and SR rng (its scale is filled here). scale / amax: DelayedScaling's
 * scale and history slot (None: 1 / a fresh amax). NULL with an exception. */
PyObject *tqx_quantize_members(tqx_state *st, PyObject *x_obj, const tq_tensor *x, void *stream,
                               const tq_quant_config *config, tq_quantize_args *qargs,
                               PyObject *scale, PyObject *amax, tq_qtensor *q,
                               tqx_pending *later);

/* Runs tq_quantize of x into q (laid out and allocated) on `stream` with the GIL released.
 * DelayedScaling: scale is the state's float32 scale, or None for 1 (a tensor made on `device`,
 * a torch.device). -1 with an exception. */
int tqx_quantize_run(tqx_state *st, const tq_tensor *x, void *stream, const tq_quant_config *config,
                     tq_quantize_args *qargs, PyObject *scale, PyObject *device, tq_qtensor *q);
/* tqx_quantize_run, or (later not NULL, no stochastic rounding, DelayedScaling with a scale
 * tensor) its record in *later. */
int tqx_quantize_or_pend(tqx_state *st, const tq_tensor *x, void *stream,
                         const tq_quant_config *config, tq_quantize_args *qargs, PyObject *scale,
                         PyObject *device, tq_qtensor *q, tqx_pending *later);
/* Stochastic rounding's rng (None, (seed, offset), or an int64 [2] tensor read at run time)
 * into qa; the tensor must outlive the quantize call (the caller holds rng). -1 with an exception. */
int tqx_rng_from_py(tqx_state *st, PyObject *rng, tq_quantize_args *qa);
/* The SR rng of a quantization of tensor x with config c from tequant._rng.rng_state (the
 * device's generator: (seed, offset), or under CUDA graph capture a device tensor drawn inside
 * the graph) into qa (fresh from TQ_QUANTIZE_ARGS_INIT: no rng), or nothing when c does not
 * round stochastically; *owner (new reference or NULL) keeps that tensor alive through the
 * quantize call. -1 with an exception. */
int tqx_rng_for(tqx_state *st, const tq_quant_config *c, PyObject *x, tq_quantize_args *qa,
                PyObject **owner);
/* members: the 6-tuple (data, scale_inv, data_t, scale_inv_t, amax, amax_t) of a QuantizedTensor
 * -> q's members that `usage` needs (laid out per tq_quantize_layout); -1 with an exception. */
int tqx_qtensor_from_py(tqx_state *st, const tq_quant_config *config, int64_t rows, int64_t cols,
                        PyObject *members, uint32_t usage, tq_qtensor *q);

/* gemm.c: one direction of a quantized tensor as a GEMM operand, and the GEMM call. */
typedef struct tqx_operand {
    tq_quant_config config;
    tq_qtensor q;
    tq_gemm_operand op;
    PyObject *any_member; /* borrowed: a tensor of the direction, for its device */
} tqx_operand;
int tqx_operand_set(tqx_state *st, const tq_quant_config *config, int64_t rows, int64_t cols,
                    PyObject *members, uint32_t usage, tqx_operand *o); /* -1 with an exception */
/* The same from a quantized tensor already laid out (a packed one, packed.c); any_member
 * (borrowed) is a tensor on its device that outlives the operand. */
void tqx_operand_of(const tq_quant_config *config, const tq_qtensor *q, uint32_t usage,
                    PyObject *any_member, tqx_operand *o);
/* out = alpha * A . B^T (+ bias) (+ out): out_obj a tensor or Py_None (then a new [M, N] of
 * out_dtype), bias_obj a tensor or Py_None; flags tq_gemm_flags. New reference, or NULL. */
PyObject *tqx_gemm_run(tqx_state *st, tqx_operand *a, tqx_operand *b, PyObject *out_obj,
                       tq_dtype out_dtype, PyObject *bias_obj, uint32_t flags);
extern PyMethodDef tqx_gemm_methods[];
/* _C._gemm (functional_ops.c's kernels call it too) */
PyObject *tqx_gemm_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* functional_ops.c: the kernels of te.ops' tequant:: ops */
extern PyMethodDef tqx_functional_ops_methods[];

/* packed.c: te.Linear's quantized operands in one uint8 buffer per part (members at offsets). */
typedef enum tqx_part { /* the same bits as tq_usage: a quantization's usage is all its parts */
    TQX_PART_ROWWISE = TQ_USAGE_ROWWISE,      /* data, scale_inv, amax */
    TQX_PART_COLUMNWISE = TQ_USAGE_COLUMNWISE /* data_t, scale_inv_t, amax_t; per-tensor FP8's
                                                 shared scale_inv and amax when quantized so */
} tqx_part;
/* Quantizes x (its current stream) with config in qargs->usage into n_parts new uint8 tensors on
 * `device` (a torch.device): bufs[i] holds the members of the tqx_part mask parts[i] (together
 * they cover the usage); q's members point into them. A part whose bit i is set in `transient`
 * goes to scratch[i] instead (bufs[i] NULL; the caller uses it within the call and releases
 * it). DelayedScaling: scale and amax (its history slot, max-accumulated in place and in no
 * buffer) must be tensors. -1 with an exception, bufs all NULL and scratch all empty. */
int tqx_quantize_packed(tqx_state *st, const tq_tensor *x, void *stream, PyObject *device,
                        const tq_quant_config *config, tq_quantize_args *qargs, PyObject *scale,
                        PyObject *amax, int n_parts, const uint32_t *parts, uint32_t transient,
                        PyObject **bufs, tqx_scratch *scratch, tq_qtensor *q,
                        tqx_pending *later);
/* One direction (usage) of a kept quantization of [rows, cols] as a GEMM operand: kept is a
 * (buffer, amax) pair holding `parts` of a rowwise + columnwise quantization (amax: the
 * DelayedScaling slot, else None), or a member 6-tuple (tqx_operand_set). -1 with an exception. */
int tqx_operand_from_kept(tqx_state *st, const tq_quant_config *config, int64_t rows,
                          int64_t cols, PyObject *kept, uint32_t parts, uint32_t usage,
                          tqx_operand *o);

/* linear_dbias.c: te.Linear's bias gradient through tq_quantize's dbias output.
 * tqx_dbias_workspace: the workspace tq_quantize needs with a dbias (quantizing x, x_obj's 2-D
 * view, with config; stream: x's current) from scratch *s (the caller releases it) into
 * *workspace. tqx_linear_dbias_new: a new [x.cols] tensor of bias_dtype (a torch.dtype) on
 * `device`, described in *dbias, and that workspace. tqx_linear_dbias_alone: the column sums
 * into dbias without a quantization (tq_act_backward of TQ_ACT_IDENTITY). NULL / -1 with an
 * exception. */
int tqx_dbias_workspace(tqx_state *st, const tq_quant_config *config, PyObject *x_obj,
                        const tq_tensor *x, void *stream, tqx_scratch *s, tq_tensor *workspace);
PyObject *tqx_linear_dbias_new(tqx_state *st, PyObject *bias_dtype, const tq_quant_config *config,
                               PyObject *x_obj, const tq_tensor *x, void *stream, PyObject *device,
                               tqx_scratch *s, tq_tensor *dbias, tq_tensor *workspace);
int tqx_linear_dbias_alone(tqx_state *st, const tq_tensor *x, void *stream,
                           const tq_tensor *dbias, const tq_tensor *workspace);

/* linear.c: te.Linear's forward and backward calls */
extern PyMethodDef tqx_linear_methods[];
PyObject *tqx_linear_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *tqx_linear_backward(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* linear_ctx.c: the forward of te.Linear's autograd Function for a plain call */
extern PyMethodDef tqx_linear_ctx_methods[];
/* linear_module.c: te.Linear.forward's plain call in C; and, for linear_ctx.c, a module's
 * DelayedScaling (scale, amax slot) pairs of dy (delayed.slots(module, "bwd")), _operands.waited(t)
 * and _norm_fn.with_columnwise(members) (new references, or NULL with an exception) */
extern PyMethodDef tqx_linear_module_methods[];
PyObject *tqx_delayed_slots_bwd(tqx_state *st, PyObject *layer);
PyObject *tqx_waited(tqx_state *st, PyObject *t);
PyObject *tqx_with_columnwise(tqx_state *st, PyObject *members);
/* packed.c: the bytes of the buffer holding `parts` of an [rows, cols] quantization laid out for
 * usage; -1 with an exception */
int64_t tqx_packed_bytes(tqx_state *st, const tq_quant_config *config, int64_t rows, int64_t cols,
                         uint32_t usage, uint32_t parts);
/* gemm.c: sets this thread's workspace-per-call flag, returns the previous one */
int tqx_gemm_workspace_per_call(int on);
/* gemm.c: 1 while that flag is set, i.e. inside a torch.compile op's call on this thread */
int tqx_in_compiled_op(void);
/* torch_calls.c: 1 once torch.compile's cudagraph trees (mode="reduce-overhead") exist in the
 * process (sticky), and 1 inside a compiled op once they do: its memory may then come from a
 * CUDA-graph pool, so it keeps no workspace past the call and returns torch.empty tensors. */
int tqx_cudagraph_trees_seen(tqx_state *st);
int tqx_op_may_use_graph_pool(tqx_state *st);
extern PyMethodDef tqx_linear_ops_methods[];
/* linear_ops.c: a recipe id's (plan tuple, DelayedScaling backward update or None) entry (new
 * reference, or NULL with an exception); an empty uint8 [0] tensor on like's device, a
 * fixed-arity op's absent output (new reference) */
PyObject *tqx_linear_entry(tqx_state *st, PyObject *recipe_id);
PyObject *tqx_absent(tqx_state *st, PyObject *like);
/* linear_ops.c: linear.c's backward on call[0..7] (its arguments) as a compiled op runs it;
 * given update (a plan entry's fused rule), the module's update of hist and scale after dy's
 * amax, run by dy's cast where one runs (new reference, or NULL with an exception) */
PyObject *tqx_backward_updating(tqx_state *st, PyObject *module, PyObject *const *call,
                                PyObject *hist, PyObject *scale, PyObject *update);

/* linear_delayed.c: a module's DelayedScaling buffers as the compiled ops take them. A state is
 * the (scale[column:column + 1], amax slot) pair the quantizers cast with and accumulate into;
 * the slot is history[0, column] (history given) or a fresh zeroed [1, 1] on device. The
 * buffers or the op's copies of them: the history (forward: x and W; backward: dy, with the
 * scale) and the states whose amax slots are its row 0. */
typedef struct tqx_delayed_buffers {
    PyObject *hist, *scale; /* scale: NULL in forward (its update runs at the autocast's exit) */
    PyObject *states[2];    /* forward: x's, W's; backward: dy's */
} tqx_delayed_buffers;
#define TQX_DELAYED_BUFFERS_INIT {NULL, NULL, {NULL, NULL}}
PyObject *tqx_delayed_state(tqx_state *st, PyObject *scale, Py_ssize_t column, PyObject *device,
                            PyObject *history); /* new reference */
void tqx_delayed_buffers_clear(tqx_delayed_buffers *c);
/* Which buffers tqx_delayed_copies takes: the forward's, or the backward's with the op's own
 * update to follow (the fused rule: the history's length checked) or with a deferred one. */
typedef enum tqx_delayed_step {
    TQX_DELAYED_FORWARD = 0,
    TQX_DELAYED_BACKWARD = 1,
    TQX_DELAYED_BACKWARD_DEFERRED = 2
} tqx_delayed_step;
/* Fills *c for a module's hist, scale under a linear plan entry after checking them against
 * like (the op's input); in_place: the buffers themselves and their kept states, else clones.
 * -1 with an exception. */
int tqx_delayed_copies(tqx_state *st, PyObject *entry, tqx_delayed_step step, PyObject *hist,
                       PyObject *scale, PyObject *like, int in_place, tqx_delayed_buffers *c);
/* _C._kept_delayed_states() -> how many histories' states are kept (tests) */
PyObject *tqx_kept_states_count(PyObject *module, PyObject *unused);

/* op_args.c: what those kernels share. A compiled op's call of fn (tqx_gemm_workspace_per_call
 * around it); TypeError unless lo <= nargs <= hi; a recipe id's linear plan entry (new
 * reference) with its DelayedScaling flag and row multiple; a module's DelayedScaling buffers
 * in place (ValueError naming hist_fwd / hist_bwd for None); a float dtype argument's tq dtype;
 * rows and k of an inp_shape tuple; a 2-D tensor's dims; a tensor's last dim. -1 (or NULL)
 * with an exception. */
typedef PyObject *(*tqx_fastcall)(PyObject *, PyObject *const *, Py_ssize_t);
enum { TQX_PLAN_INPUT = 1, TQX_PLAN_GRAD_OUTPUT = 3 }; /* the configs' places in a plan tuple */
PyObject *tqx_in_op(tqx_fastcall fn, PyObject *module, PyObject *const *args, Py_ssize_t n);
int tqx_op_arity(const char *fn, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi);
int tqx_op_entry(tqx_state *st, PyObject *recipe_id, PyObject **entry, int *delayed,
                 long long *align);
int tqx_op_module_states(tqx_state *st, PyObject *entry, tqx_delayed_step step, PyObject *hist,
                         PyObject *scale, PyObject *like, tqx_delayed_buffers *c);
int tqx_op_float_dtype(tqx_state *st, PyObject *dtype, const char *name);
int tqx_op_rows_cols(PyObject *shape, long long *rows, long long *k);
int tqx_op_dims2(PyObject *t, const char *name, long long dims[2]);
long long tqx_op_last_dim(PyObject *t, const char *name);

/* amax_update.c: _amax_update, delayed scaling's history roll and scale update */
extern PyMethodDef tqx_amax_update_methods[];
/* "max" / "most_recent" (a callable: TQ_AMAX_ALGO_CUSTOM, which the core refuses); -1 with an
 * exception otherwise. */
int tqx_amax_algo_from_py(PyObject *obj, tq_amax_algo *out);
/* The fused update, in place, of n_buffers histories (float32 [history_len, c_i]: a module's
 * direction) and their scales (contiguous float32 [c_i], on the first history's device), the
 * columns taken in order (buffer 0's first), column j with scaled max j; update is
 * (history_len, algo, tuple of sum c_i scaled maxes); reduced NULL / None or a contiguous
 * float32 tensor of sum c_i all-reduced amaxes (tq_amax_update_args.reduced_amax). Runs on the
 * first history's current stream. -1 with an exception (ValueError naming the tensors, indexed
 * when n_buffers > 1, for a wrong shape, dtype or device). */
#define TQX_UPDATE_COLUMNS 4
int tqx_amax_update_buffers(tqx_state *st, Py_ssize_t n_buffers, PyObject *const *histories,
                            PyObject *const *scales, PyObject *update, PyObject *reduced,
                            const char *history_name, const char *scale_name);

/* One column's update as tq_quantize_args.update takes it: hist_bwd (float32 [history_len, 1])
 * and scale_bwd (float32 [1]) with update (history_len, algo, (scaled max,)) -> *out (args.device
 * and stream the history's; done 0, set by the quantization that ran it). -1 with an exception.
 * tqx_amax_update_run: the update alone, on that stream (where no cast ran it). */
typedef struct tqx_update {
    tq_amax_slot slot;
    tq_amax_update_args args;
    void *stream;
    int done;
} tqx_update;
int tqx_amax_update_one(tqx_state *st, PyObject *history, PyObject *scale, PyObject *update,
                        tqx_update *out);
int tqx_amax_update_run(tqx_state *st, tqx_update *u);
/* linear.c: tqx_linear_backward whose grad_output quantization also runs *update (done set
 * when it did: not where no dy quantization runs) */
PyObject *tqx_linear_backward_updating(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                       tqx_update *update);

/* autocast.c + state.c */
int tqx_autocast_init(PyObject *module, tqx_state *st);
extern PyMethodDef tqx_autocast_methods[];
extern PyMethodDef tqx_state_methods[];
/* state.c: _C._live, the read-only view of the current state torch.compile guards on */
int tqx_live_state_init(PyObject *module, tqx_state *st);

/* "cpu" or "cuda:N", for messages. */
static inline const char *tqx_device_name(int device, char *buf, size_t cap) {
    if (device == TQ_DEVICE_CPU) snprintf(buf, cap, "cpu");
    else snprintf(buf, cap, "cuda:%d", device);
    return buf;
}

static inline tqx_state *tqx_module_state(PyObject *module) {
    return (tqx_state *)PyModule_GetState(module);
}

#endif /* TEQUANT_EXT_MODULE_H_ */

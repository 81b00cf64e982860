/* codec.c: _C._codec(name, x, out), the scalar codecs of formats.h applied elementwise
 * (tq_codec_apply). For tests and for inspecting formats; not a public API.
 *
 * Codes travel as torch.uint8, or as the format's own float8 dtype (float8_e4m3fn, float8_e5m2,
 * float8_e8m0fnu: the same bytes). Runs on x's device and current CUDA stream with the GIL
 * released. Tests: tests/test_formats.py.
 */
#include <string.h>

#include "module.h"

#define CODE_DTYPES \
    ((1u << TQ_DTYPE_UINT8) | (1u << TQ_DTYPE_FLOAT8_E4M3) | (1u << TQ_DTYPE_FLOAT8_E5M2) \
     | (1u << TQ_DTYPE_FLOAT8_E8M0))
#define F32_DTYPE (1u << TQ_DTYPE_FLOAT32)
#define F16_DTYPES ((1u << TQ_DTYPE_BFLOAT16) | (1u << TQ_DTYPE_FLOAT16))

/* Indexed by tq_codec; the dtype masks only narrow what intake accepts (the core checks each
 * codec's exact dtypes and names them in its message). */
static const struct {
    const char *name;
    uint32_t in_mask, out_mask;
} codec_names[TQ_CODEC_COUNT_] = {
    [TQ_CODEC_F32_TO_E4M3] = {"f32_to_e4m3", F32_DTYPE, CODE_DTYPES},
    [TQ_CODEC_F32_TO_E5M2] = {"f32_to_e5m2", F32_DTYPE, CODE_DTYPES},
    [TQ_CODEC_F32_TO_E2M1] = {"f32_to_e2m1", F32_DTYPE, CODE_DTYPES},
    [TQ_CODEC_F32_TO_E8M0] = {"f32_to_e8m0", F32_DTYPE, CODE_DTYPES},
    [TQ_CODEC_F32_TO_BF16] = {"f32_to_bf16", F32_DTYPE, F16_DTYPES},
    [TQ_CODEC_F32_TO_F16] = {"f32_to_f16", F32_DTYPE, F16_DTYPES},
    [TQ_CODEC_E4M3_TO_F32] = {"e4m3_to_f32", CODE_DTYPES, F32_DTYPE},
    [TQ_CODEC_E5M2_TO_F32] = {"e5m2_to_f32", CODE_DTYPES, F32_DTYPE},
    [TQ_CODEC_E2M1_TO_F32] = {"e2m1_to_f32", CODE_DTYPES, F32_DTYPE},
    [TQ_CODEC_E8M0_TO_F32] = {"e8m0_to_f32", CODE_DTYPES, F32_DTYPE},
};

static int codec_from_name(PyObject *name, tq_codec *out) {
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "_codec: name must be a str, got %s", Py_TYPE(name)->tp_name);
        return -1;
    }
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL) return -1;
    for (int c = 0; c < TQ_CODEC_COUNT_; c++) {
        if (strcmp(s, codec_names[c].name) == 0) {
            *out = (tq_codec)c;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "_codec: unknown codec %R; expected one of 'f32_to_e4m3', "
                 "'f32_to_e5m2', 'f32_to_e2m1', 'f32_to_e8m0', 'f32_to_bf16', 'f32_to_f16', "
                 "'e4m3_to_f32', 'e5m2_to_f32', 'e2m1_to_f32', 'e8m0_to_f32'", name);
    return -1;
}

/* _codec(name, x, out): out = codec(x) elementwise, same shape, same device. */
static PyObject *py_codec(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "_codec(name, x, out) takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    tqx_state *st = tqx_module_state(module);
    tq_codec codec;
    if (codec_from_name(args[0], &codec) < 0) return NULL;
    tq_tensor x, out;
    tqx_tensor_info info;
    if (tqx_tensor_from_py(st, args[1], "x", codec_names[codec].in_mask, &x, &info) < 0
        || tqx_tensor_from_py(st, args[2], "out", codec_names[codec].out_mask, &out, NULL) < 0)
        return NULL;
    tq_status s;
    Py_BEGIN_ALLOW_THREADS
    s = tq_codec_apply(codec, &x, &out, (struct CUstream_st *)info.stream);
    Py_END_ALLOW_THREADS
    if (s != TQ_SUCCESS) return tqx_raise_status(st, s);
    Py_RETURN_NONE;
}

PyMethodDef tqx_codec_methods[] = {
    {"_codec", (PyCFunction)(void (*)(void))py_codec, METH_FASTCALL,
     "_codec(name, x, out)\n\nout = codec(x) elementwise with tequant's scalar rules (formats.h), "
     "on x's device and current stream. name: 'f32_to_e4m3', 'f32_to_e5m2', 'f32_to_e2m1' (one "
     "code per byte), 'f32_to_e8m0' (rounded up), 'f32_to_bf16', 'f32_to_f16' (RNE), "
     "'e4m3_to_f32', 'e5m2_to_f32', 'e2m1_to_f32' (low nibble), 'e8m0_to_f32'. Codes are "
     "torch.uint8 (or the format's float8 dtype); x and out have the same shape."},
    {NULL, NULL, 0, NULL}};

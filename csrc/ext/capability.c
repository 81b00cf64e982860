/* capability.c: which execution mode a recipe gets on a device, and autocast's enter check.
 *
 *   CPU tensors (or no CUDA device/driver/build)  -> cpu-reference: the C reference path
 *   CUDA, compute capability < 9.0                -> unsupported: kernels are built for sm_90+
 *   CUDA, per-tensor FP8 (delayed, current)       -> native: cuBLASLt FP8 GEMMs
 *   CUDA 9.x, FP8 block scaling                   -> native with cuBLASLt >= 12.9, else unsupported
 *   CUDA >= 10.0, FP8 block scaling               -> unsupported (cuBLASLt's VEC128/BLK128 modes
 *                                                    are Hopper-only; no Blackwell path yet)
 *   CUDA >= 9.0, MXFP8 / NVFP4                    -> emulated: real quantized operands,
 *                                                    dequantized exactly to BF16 for a BF16 GEMM
 *   CUDA >= 9.0, CustomRecipe                     -> emulated: the factory's quantizers, GEMMs on
 *                                                    their dequantized values
 * Device facts are queried once per process. The enter check is cached per recipe when all
 * devices are alike, so autocast.__enter__ costs no device query. Tests: tests/test_device.py.
 */
#include <stdio.h>
#include <string.h>

#include "module.h"

static const char *const mode_names[] = {"native", "emulated", "cpu-reference", "unsupported"};

/* Queries device count, capabilities and the cuBLASLt version once. -1 with an exception. */
static int query_devices(tqx_state *st) {
    if (st->device_count >= 0) return 0;
    int n = 0;
    tq_status s = tq_device_count(&n);
    if (s != TQ_SUCCESS) {
        tqx_raise_status(st, s);
        return -1;
    }
    if (n > TQX_MAX_DEVICES) n = TQX_MAX_DEVICES;
    st->devices_alike = 1;
    for (int d = 0; d < n; d++) {
        int major = 0, minor = 0;
        s = tq_device_capability(d, &major, &minor);
        if (s != TQ_SUCCESS) {
            tqx_raise_status(st, s);
            return -1;
        }
        st->cc[d] = 10 * major + minor;
        if (st->cc[d] != st->cc[0]) st->devices_alike = 0;
    }
    if (n > 0) {
        s = tq_cublaslt_version(&st->cublaslt_version);
        if (s != TQ_SUCCESS) {
            tqx_raise_status(st, s);
            return -1;
        }
    }
    st->device_count = n;
    return 0;
}

tqx_mode tqx_execution_mode(tqx_state *st, tqx_recipe_kind kind, int device, PyObject **reason) {
    *reason = NULL;
    if (query_devices(st) < 0) return (tqx_mode)-1;
    if (device < 0) {
        *reason = PyUnicode_FromString(
            st->device_count == 0
                ? "no CUDA device is usable here (no GPU, no driver, or a build without CUDA): "
                  "every recipe runs through tequant's C reference path on the CPU (slow; exact "
                  "quantized bits)"
                : "CPU tensors run through tequant's C reference path (slow; exact quantized bits)");
        return *reason ? TQX_MODE_CPU_REFERENCE : (tqx_mode)-1;
    }
    if (device >= st->device_count) {
        PyErr_Format(PyExc_ValueError, "cuda:%d is not a CUDA device this process can use "
                     "(it sees %d)", device, st->device_count);
        return (tqx_mode)-1;
    }
    const int cc = st->cc[device], major = cc / 10, minor = cc % 10;
    tqx_mode mode;
    if (cc < 90) {
        mode = TQX_MODE_UNSUPPORTED;
        *reason = PyUnicode_FromFormat("cuda:%d has compute capability %d.%d; tequant's CUDA "
                                       "kernels need 9.0 (Hopper) or newer", device, major, minor);
    } else if (kind == TQX_RECIPE_DELAYED || kind == TQX_RECIPE_CURRENT) {
        mode = TQX_MODE_NATIVE;
        *reason = PyUnicode_FromFormat("FP8 GEMMs through cuBLASLt on compute capability %d.%d",
                                       major, minor);
    } else if (kind == TQX_RECIPE_BLOCK) {
        if (cc >= 100) {
            mode = TQX_MODE_UNSUPPORTED;
            *reason = PyUnicode_FromFormat(
                "FP8 block scaling (1x128/128x128 FP32 scales) uses cuBLASLt's Hopper-only scale "
                "modes; compute capability %d.%d has no tequant path for it yet", major, minor);
        } else if (st->cublaslt_version < 120900) {
            mode = TQX_MODE_UNSUPPORTED;
            *reason = PyUnicode_FromFormat("FP8 block-scaled GEMMs need cuBLASLt 12.9 or newer; "
                                           "the loaded cuBLASLt is %zu",
                                           st->cublaslt_version);
        } else {
            mode = TQX_MODE_NATIVE;
            *reason = PyUnicode_FromString("FP8 block-scaled GEMMs (VEC128 / BLK128x128 FP32 "
                                           "scales) through cuBLASLt on Hopper");
        }
    } else if (kind == TQX_RECIPE_CUSTOM) {
        mode = TQX_MODE_EMULATED;
        *reason = PyUnicode_FromString("CustomRecipe: the factory's quantizers quantize and "
                                       "dequantize; GEMMs run on the dequantized values");
    } else {
        mode = TQX_MODE_EMULATED;
        *reason = PyUnicode_FromFormat(
            "compute capability %d.%d: %s operands are quantized for real (the same bits as on "
            "Blackwell) and dequantized exactly to BF16 for a BF16 GEMM with FP32 accumulation%s",
            major, minor, kind == TQX_RECIPE_MXFP8 ? "MXFP8" : "NVFP4",
            cc < 100 ? " (Hopper has no MXFP8/NVFP4 GEMM)"
                     : " (tequant does not use Blackwell's block-scaled GEMMs yet)");
    }
    return *reason ? mode : (tqx_mode)-1;
}

/* Mode on the device autocast runs on: the current CUDA device, or the CPU without one. */
static int current_device(tqx_state *st, int *device) {
    if (query_devices(st) < 0) return -1;
    if (st->device_count == 0 || st->devices_simulated) {
        *device = st->device_count == 0 ? -1 : 0;
        return 0;
    }
    tq_status s = tq_current_device(device);
    if (s != TQ_SUCCESS) {
        tqx_raise_status(st, s);
        return -1;
    }
    return 0;
}

int tqx_check_enter(tqx_state *st, tqx_recipe_entry *entry) {
    if (entry->enter_check == TQX_ENTER_OK) return 0;
    if (entry->enter_check == TQX_ENTER_REFUSED) {
        PyErr_SetObject(PyExc_RuntimeError, entry->refusal);
        return -1;
    }
    int device;
    if (current_device(st, &device) < 0) return -1;
    PyObject *reason;
    tqx_mode mode = tqx_execution_mode(st, entry->kind, device, &reason);
    if ((int)mode < 0) return -1;
    if (entry->enter_check == TQX_ENTER_UNKNOWN && st->devices_alike) {
        entry->enter_check = mode == TQX_MODE_UNSUPPORTED ? TQX_ENTER_REFUSED : TQX_ENTER_OK;
        if (mode == TQX_MODE_UNSUPPORTED) entry->refusal = Py_NewRef(reason);
    } else {
        entry->enter_check = TQX_ENTER_PER_DEVICE;
    }
    if (mode == TQX_MODE_UNSUPPORTED) PyErr_SetObject(PyExc_RuntimeError, reason);
    Py_DECREF(reason);
    return mode == TQX_MODE_UNSUPPORTED ? -1 : 0;
}

/* ---- Python: execution_mode(recipe, device=None), device_info() ---- */

static PyStructSequence_Field mode_fields[] = {
    {"mode", "'native', 'emulated', 'cpu-reference' or 'unsupported'"},
    {"reason", "why, in words"},
    {NULL, NULL}};

static PyStructSequence_Desc mode_desc = {
    "tequant.ExecutionMode", "How a recipe runs on a device: (mode, reason).", mode_fields, 2};

static int bad_device(PyObject *obj) {
    PyErr_Format(PyExc_ValueError, "device must be None, an int, 'cpu', 'cuda', 'cuda:N' or a "
                 "torch.device; got %R", obj);
    return -1;
}

/* device: None (current), an int (a CUDA ordinal; -1 = CPU), 'cpu', 'cpu:N', 'cuda', 'cuda:N',
 * or a torch.device (it prints as one of those strings). */
static int parse_device(tqx_state *st, PyObject *obj, int *device) {
    if (obj == Py_None) return current_device(st, device);
    if (PyBool_Check(obj)) return bad_device(obj);
    if (PyLong_Check(obj)) {
        int overflow;
        long v = PyLong_AsLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred()) return -1;
        if (overflow || v < -1 || v >= TQX_MAX_DEVICES) {
            PyErr_Format(PyExc_ValueError, "device=%R is not a CUDA ordinal (0..%d) or -1 (CPU)",
                         obj, TQX_MAX_DEVICES - 1);
            return -1;
        }
        *device = (int)v;
        return 0;
    }
    PyObject *text = PyObject_Str(obj);
    if (text == NULL) return -1;
    const char *s = PyUnicode_AsUTF8(text);
    int ok = 0, used = 0, ordinal = -1;
    if (s != NULL) {
        if (strcmp(s, "cpu") == 0 || (sscanf(s, "cpu:%d%n", &ordinal, &used) == 1 && s[used] == '\0'
                                      && ordinal >= 0)) {
            *device = -1;
            ok = 1;
        } else if (strcmp(s, "cuda") == 0) {
            Py_DECREF(text);
            if (current_device(st, device) < 0) return -1;
            if (*device < 0) {
                PyErr_SetString(PyExc_ValueError, "device 'cuda': no CUDA device is usable here");
                return -1;
            }
            return 0;
        } else if (sscanf(s, "cuda:%d%n", &ordinal, &used) == 1 && s[used] == '\0' && ordinal >= 0
                   && s[5] != '+' && s[5] != ' ') {
            *device = ordinal;
            ok = 1;
        }
    }
    Py_DECREF(text);
    if (s == NULL) return -1;
    return ok ? 0 : bad_device(obj);
}

static PyObject *py_execution_mode(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"recipe", "device", NULL};
    PyObject *recipe = Py_None, *device_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:execution_mode", kwlist, &recipe, &device_obj))
        return NULL;
    tqx_state *st = tqx_module_state(module);
    if (recipe == Py_None) {
        if (tqx_recipe_import(st) < 0) return NULL;
        recipe = st->default_recipe;
    }
    Py_ssize_t key = tqx_recipe_key(st, recipe);
    int device;
    if (key < 0 || parse_device(st, device_obj, &device) < 0) return NULL;
    PyObject *reason;
    tqx_mode mode = tqx_execution_mode(st, st->recipes[key].kind, device, &reason);
    if ((int)mode < 0) return NULL;
    PyObject *result = PyStructSequence_New(st->execution_mode_type);
    if (result == NULL) {
        Py_DECREF(reason);
        return NULL;
    }
    PyStructSequence_SetItem(result, 0, PyUnicode_FromString(mode_names[mode]));
    PyStructSequence_SetItem(result, 1, reason);
    if (PyStructSequence_GetItem(result, 0) == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *py_device_info(PyObject *module, PyObject *unused) {
    (void)unused;
    tqx_state *st = tqx_module_state(module);
    if (query_devices(st) < 0) return NULL;
    PyObject *caps = PyList_New(st->device_count);
    if (caps == NULL) return NULL;
    for (int d = 0; d < st->device_count; d++)
        PyList_SET_ITEM(caps, d, Py_BuildValue("(ii)", st->cc[d] / 10, st->cc[d] % 10));
    tq_build_info info = TQ_BUILD_INFO_INIT;
    tq_get_build_info(&info);
    return Py_BuildValue("{s:O,s:i,s:i,s:i,s:N,s:n}", "with_cuda", info.with_cuda ? Py_True : Py_False,
                         "cuda_runtime_version", info.cuda_runtime_version,
                         "cublaslt_header_version", info.cublaslt_header_version,
                         "device_count", st->device_count, "capabilities", caps,
                         "cublaslt_version", (Py_ssize_t)st->cublaslt_version);
}

/* Test hook: replace the queried device facts (capabilities, cuBLASLt version) so the rules
 * above and autocast's refusal path can be tested on any machine; None restores the real ones.
 * Every recipe's cached enter check is dropped either way. */
static PyObject *py_set_device_facts(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"capabilities", "cublaslt_version", NULL};
    PyObject *caps = Py_None;
    Py_ssize_t version = 130100;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|On:_set_device_facts", kwlist, &caps, &version))
        return NULL;
    tqx_state *st = tqx_module_state(module);
    for (Py_ssize_t i = 0; i < st->n_recipes; i++) {
        st->recipes[i].enter_check = TQX_ENTER_UNKNOWN;
        Py_CLEAR(st->recipes[i].refusal);
    }
    st->device_count = -1;
    st->devices_simulated = 0;
    st->cublaslt_version = 0; /* re-queried with the real devices */
    if (caps == Py_None) Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(caps, "capabilities must be a list of (major, minor)");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > TQX_MAX_DEVICES) n = TQX_MAX_DEVICES;
    st->devices_alike = 1;
    for (Py_ssize_t d = 0; d < n; d++) {
        int major, minor;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, d), "ii", &major, &minor)) {
            Py_DECREF(seq);
            return NULL;
        }
        st->cc[d] = 10 * major + minor;
        if (st->cc[d] != st->cc[0]) st->devices_alike = 0;
    }
    Py_DECREF(seq);
    st->device_count = (int)n;
    st->devices_simulated = 1;
    st->cublaslt_version = (size_t)version;
    Py_RETURN_NONE;
}

PyMethodDef tqx_capability_methods[] = {
    {"_set_device_facts", (PyCFunction)(void (*)(void))py_set_device_facts,
     METH_VARARGS | METH_KEYWORDS,
     "_set_device_facts(capabilities=None, cublaslt_version=130100)\n\nTest hook: pretend the "
     "devices have these compute capabilities (current device 0); None restores the real facts."},
    {"execution_mode", (PyCFunction)(void (*)(void))py_execution_mode, METH_VARARGS | METH_KEYWORDS,
     "execution_mode(recipe=None, device=None) -> ExecutionMode(mode, reason)\n\n"
     "How `recipe` runs on `device` (None: the current CUDA device, or the CPU without one):\n"
     "'native' (FP8 tensor-core GEMMs), 'emulated' (real quantized operands, BF16 GEMM),\n"
     "'cpu-reference' (the C reference path) or 'unsupported', with the reason."},
    {"build_info", py_device_info, METH_NOARGS,
     "build_info() -> dict: whether CUDA is compiled in, versions, devices and capabilities."},
    {NULL, NULL, 0, NULL}};

int tqx_capability_init(PyObject *module, tqx_state *st) {
    st->device_count = -1;
    st->execution_mode_type = PyStructSequence_NewType(&mode_desc);
    if (st->execution_mode_type == NULL) return -1;
    return PyModule_AddType(module, st->execution_mode_type);
}

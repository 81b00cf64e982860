/* errors.c: tq_status -> Python exception, in one place, and the tequant.CudaError type.
 *
 *   TQ_ERROR_INVALID_ARGUMENT -> ValueError        TQ_ERROR_NOT_SUPPORTED -> NotImplementedError
 *   TQ_ERROR_CUDA, _CUBLAS    -> tequant.CudaError TQ_ERROR_OUT_OF_MEMORY -> MemoryError
 *   TQ_ERROR_INTERNAL         -> SystemError (a bug in tequant: please report it)
 * The message is the core's thread-local tq_last_error(). Tests: tests/test_errors.py.
 */
#include "module.h"

PyObject *tqx_raise_status(tqx_state *st, tq_status status) {
    const char *message = tq_last_error();
    if (message[0] == '\0') message = tq_status_string(status);
    PyObject *type;
    switch (status) {
        case TQ_SUCCESS:
            PyErr_SetString(PyExc_SystemError, "tequant: tqx_raise_status(TQ_SUCCESS)");
            return NULL;
        case TQ_ERROR_INVALID_ARGUMENT: type = PyExc_ValueError; break;
        case TQ_ERROR_NOT_SUPPORTED: type = PyExc_NotImplementedError; break;
        case TQ_ERROR_CUDA:
        case TQ_ERROR_CUBLAS: type = st->cuda_error; break;
        case TQ_ERROR_OUT_OF_MEMORY: type = PyExc_MemoryError; break;
        default: type = PyExc_SystemError; break;
    }
    PyErr_SetString(type, message);
    return NULL;
}

int tqx_errors_init(PyObject *module, tqx_state *st) {
    st->cuda_error = PyErr_NewExceptionWithDoc(
        "tequant.CudaError",
        "A CUDA runtime, kernel launch or cuBLASLt call failed inside tequant. The message names "
        "the call and CUDA's error.",
        PyExc_RuntimeError, NULL);
    if (st->cuda_error == NULL) return -1;
    return PyModule_AddObjectRef(module, "CudaError", st->cuda_error);
}

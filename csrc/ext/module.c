/* module.c: the tequant._C extension module: multi-phase init, module state, function tables.
 *
 * Every object the module owns (types, exception, ContextVar, recipe table) lives in tqx_state,
 * created in exec and released in clear/free, so the module can be loaded in several
 * interpreters and reloaded. The extension links no libtorch; it sees tensors through DLPack.
 * Tests: every tests/test_*.py imports it; tests/test_build.py checks the build flavour.
 */
#include "module.h"

static int tequant_exec(PyObject *module) {
    tqx_state *st = tqx_module_state(module); /* zeroed by CPython */
    st->str_enabled = PyUnicode_InternFromString("enabled");
    st->str_calibrating = PyUnicode_InternFromString("calibrating");
    st->str_recipe = PyUnicode_InternFromString("recipe");
    st->str_amax_reduction_group = PyUnicode_InternFromString("amax_reduction_group");
    if (!st->str_enabled || !st->str_calibrating || !st->str_recipe || !st->str_amax_reduction_group)
        return -1;
    if (tqx_errors_init(module, st) < 0 || tqx_registry_init(module, st) < 0
        || tqx_capability_init(module, st) < 0 || tqx_autocast_init(module, st) < 0
        || tqx_live_state_init(module, st) < 0)
        return -1;
    PyMethodDef *tables[] = {tqx_registry_methods, tqx_capability_methods, tqx_state_methods,
                             tqx_tensor_view_methods, tqx_ops_methods, tqx_quantize_methods,
                             tqx_codec_methods, tqx_gemm_methods, tqx_amax_update_methods,
                             tqx_linear_methods, tqx_linear_ctx_methods, tqx_linear_module_methods,
                             tqx_linear_ops_methods,
                             tqx_autocast_methods, tqx_norm_methods, tqx_act_methods,
                             tqx_fused_ops_methods, tqx_given_ops_methods,
                             tqx_dy_given_methods, tqx_functional_ops_methods};
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; i++)
        if (PyModule_AddFunctions(module, tables[i]) < 0) return -1;
    /* the bit values Python passes to the C calls, named once (here) for every Python module */
    static const struct { const char *name; long value; } constants[] = {
        {"USAGE_ROWWISE", TQ_USAGE_ROWWISE},       {"USAGE_COLUMNWISE", TQ_USAGE_COLUMNWISE},
        {"GEMM_ACCUMULATE", TQ_GEMM_ACCUMULATE},   {"GEMM_FAST_ACCUM", TQ_GEMM_FAST_ACCUM},
        {"LINEAR_NEED_DGRAD", TQX_NEED_DGRAD},     {"LINEAR_NEED_WGRAD", TQX_NEED_WGRAD},
        {"LINEAR_KEEP_X_ROWWISE", TQX_KEEP_X_ROWWISE}, {"LINEAR_PACKED", TQX_PACKED},
        {"LINEAR_DEFER_UPDATE", TQX_DEFER_UPDATE}};
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(module, constants[i].name, constants[i].value) < 0) return -1;
    return 0;
}

static int tequant_traverse(PyObject *module, visitproc visit, void *arg) {
    tqx_state *st = tqx_module_state(module);
    if (st == NULL) return 0;
    Py_VISIT(st->autocast_type);
    Py_VISIT(st->execution_mode_type);
    Py_VISIT(st->cuda_error);
    Py_VISIT(st->context_var);
    Py_VISIT(st->recipe_base);
    for (int k = 0; k < TQX_RECIPE_KIND_COUNT; k++) Py_VISIT(st->recipe_classes[k]);
    Py_VISIT(st->default_recipe);
    Py_VISIT(st->dlpack_type);
    Py_VISIT(st->alloc_device);
    Py_VISIT(st->delayed_update);
    Py_VISIT(st->delayed_backward_update);
    Py_VISIT(st->rng_state);
    Py_VISIT(st->linear_plans);
    Py_VISIT(st->linear_plan_of);
    Py_VISIT(st->op_configs);
    Py_VISIT(st->op_config_of);
    Py_VISIT(st->delayed_states);
    for (int i = 0; i < TQX_LINEAR_MODULE_SLOTS; i++) Py_VISIT(st->linear_module[i]);
    const int visited = tqx_torch_traverse(st, visit, arg);
    if (visited != 0) return visited;
    return tqx_registry_traverse(st, visit, arg);
}

static int tequant_clear(PyObject *module) {
    tqx_state *st = tqx_module_state(module);
    if (st == NULL) return 0;
    tqx_registry_clear(st);
    tqx_torch_clear(st);
    Py_CLEAR(st->autocast_type);
    Py_CLEAR(st->execution_mode_type);
    Py_CLEAR(st->cuda_error);
    Py_CLEAR(st->context_var);
    Py_CLEAR(st->recipe_base);
    for (int k = 0; k < TQX_RECIPE_KIND_COUNT; k++) Py_CLEAR(st->recipe_classes[k]);
    Py_CLEAR(st->default_recipe);
    Py_CLEAR(st->dlpack_type);
    Py_CLEAR(st->alloc_device);
    Py_CLEAR(st->delayed_update);
    Py_CLEAR(st->delayed_backward_update);
    Py_CLEAR(st->rng_state);
    Py_CLEAR(st->linear_plans);
    Py_CLEAR(st->linear_plan_of);
    Py_CLEAR(st->op_configs);
    Py_CLEAR(st->op_config_of);
    Py_CLEAR(st->delayed_states);
    for (int i = 0; i < TQX_LINEAR_MODULE_SLOTS; i++) Py_CLEAR(st->linear_module[i]);
    Py_CLEAR(st->str_enabled);
    Py_CLEAR(st->str_calibrating);
    Py_CLEAR(st->str_recipe);
    Py_CLEAR(st->str_amax_reduction_group);
    return 0;
}

static void tequant_free(void *module) { tequant_clear((PyObject *)module); }

static PyModuleDef_Slot tequant_slots[] = {
    {Py_mod_exec, tequant_exec},
    {0, NULL}};

static struct PyModuleDef tequant_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tequant._C",
    .m_doc = "tequant's C extension: te.autocast, recipe keys, the quantizer registry, tensor "
             "intake, and the calls into the C/CUDA core.",
    .m_size = sizeof(tqx_state),
    .m_slots = tequant_slots,
    .m_traverse = tequant_traverse,
    .m_clear = tequant_clear,
    .m_free = tequant_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&tequant_module); }

/* test_header.c: proves csrc/include/tequant/tequant.h is self-contained, clean C99 and usable
 * from C++. It includes nothing but the header; tests/test_core.py compiles it (object only, no
 * link) with `gcc -std=c99 -pedantic -Wall -Wextra -Werror` and `g++ -std=c++17 -x c++ -Werror`.
 * It checks the initializer macros, the descriptor types and the API prototypes at compile time.
 */
#include <tequant/tequant.h>

/* Compile-time checks that work in C99 and C++ alike (no _Static_assert in C99). */
#define TQ_TEST_CHECK(name, cond) typedef char tq_test_check_##name[(cond) ? 1 : -1]

TQ_TEST_CHECK(success_is_zero, TQ_SUCCESS == 0);
TQ_TEST_CHECK(device_cpu_is_minus_one, TQ_DEVICE_CPU == -1);
TQ_TEST_CHECK(dtype_count, TQ_DTYPE_COUNT_ == 10);
TQ_TEST_CHECK(config_size_first, offsetof(tq_quant_config, struct_size) == 0);
TQ_TEST_CHECK(build_info_size_first, offsetof(tq_build_info, struct_size) == 0);
TQ_TEST_CHECK(tensor_data_first, offsetof(tq_tensor, data) == 0);
TQ_TEST_CHECK(flags_distinct, (TQ_QUANT_POW2_SCALE | TQ_QUANT_RHT | TQ_QUANT_STOCHASTIC_ROUNDING
                               | TQ_QUANT_2D) == 15);

/* Every public entry point keeps the prototype callers are compiled against. */
typedef struct tq_test_api {
    const char *(*status_string)(tq_status);
    const char *(*last_error)(void);
    const char *(*dtype_name)(tq_dtype);
    int (*dtype_bits)(tq_dtype);
    tq_status (*tensor_check)(const tq_tensor *, const char *);
    tq_status (*quant_config_check)(const tq_quant_config *);
    tq_status (*get_build_info)(tq_build_info *);
    tq_status (*device_count)(int *);
    tq_status (*device_capability)(int, int *, int *);
    tq_status (*current_device)(int *);
    tq_status (*cublaslt_version)(size_t *);
} tq_test_api;

const tq_test_api *tq_test_header_api(void);
int tq_test_header_use(void);

const tq_test_api *tq_test_header_api(void) {
    static const tq_test_api api = {tq_status_string,   tq_last_error,   tq_dtype_name,
                                    tq_dtype_bits,      tq_tensor_check, tq_quant_config_check,
                                    tq_get_build_info,  tq_device_count, tq_device_capability,
                                    tq_current_device,  tq_cublaslt_version};
    return &api;
}

int tq_test_header_use(void) {
    tq_quant_config config = TQ_QUANT_CONFIG_INIT;
    tq_build_info info = TQ_BUILD_INFO_INIT;
    tq_norm_forward_args norm_fwd = TQ_NORM_FORWARD_ARGS_INIT;
    tq_norm_backward_args norm_bwd = TQ_NORM_BACKWARD_ARGS_INIT;
    unsigned char byte = 0;
    tq_tensor t;
    struct CUstream_st *stream = NULL; /* launching calls take this; declared by the header */
    t.data = &byte;
    t.rows = 1;
    t.cols = 1;
    t.ld = 1;
    t.dtype = TQ_DTYPE_UINT8;
    t.device = TQ_DEVICE_CPU;
    config.scaling = TQ_SCALING_MXFP8;
    config.elem_dtype = TQ_DTYPE_FLOAT8_E4M3;
    config.scale_dtype = TQ_DTYPE_FLOAT8_E8M0;
    config.block_rows = 1;
    config.block_cols = 32;
    config.flags = (uint32_t)TQ_QUANT_POW2_SCALE;
    config.fmax = 448.0f;
    config.amax_algo = TQ_AMAX_ALGO_MOST_RECENT;
    return (int)(config.struct_size == sizeof(tq_quant_config))
           + (int)(info.struct_size == sizeof(tq_build_info)) + (int)(t.rows * t.cols)
           + (int)(stream == NULL) + (int)config.block_cols
           + (int)(norm_fwd.struct_size == sizeof(tq_norm_forward_args) && norm_fwd.config == NULL)
           + (int)(norm_bwd.struct_size == sizeof(tq_norm_backward_args)
                   && norm_bwd.norm == TQ_NORM_LAYERNORM);
}

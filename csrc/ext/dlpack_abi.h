/* dlpack_abi.h: the parts of the DLPack 1.x C ABI that tequant's tensor intake reads.
 *
 * Declared here (from the DLPack specification's struct layouts) rather than included from
 * torch, so the build needs no torch headers. Only what tensor_view.c and torch_calls.c use is
 * declared: the tensor description, the managed tensor (torch_calls.c allocates through the
 * table) and the `__dlpack_c_exchange_api__` function table that a framework puts on its tensor
 * type as a PyCapsule named "dlpack_exchange_api".
 * Tests: tests/test_tensor_view.py.
 */
#ifndef TEQUANT_EXT_DLPACK_ABI_H_
#define TEQUANT_EXT_DLPACK_ABI_H_

#include <stdint.h>

#define TQX_DLPACK_MAJOR 1

enum { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLROCM = 10, kDLCUDAManaged = 13 };

enum {
    kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6,
    kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12, kDLFloat8_e8m0fnu = 14, kDLFloat4_e2m1fn = 17
};

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; never NULL for ndim > 0 since DLPack 1.2 */
    uint64_t byte_offset;
} DLTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

/* The function table; every function returns 0 on success, -1 with a Python error set. */
typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                    void *error_ctx,
                                    void (*set_error)(void *error_ctx, const char *kind,
                                                      const char *message));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object, DLManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                               void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out); /* may be NULL */
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

#endif /* TEQUANT_EXT_DLPACK_ABI_H_ */

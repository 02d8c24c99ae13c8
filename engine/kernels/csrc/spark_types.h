/* What every public header of the kernel library shares: the status codes its fallible entry points
 * return, and the linear kernels' paths. The Python bindings (engine/kernels/signatures.py) mirror these
 * values; tests/engine/test_kernel_signatures.py checks that they agree. */
#ifndef SPARK_TYPES_H
#define SPARK_TYPES_H

#include <stdint.h>

/* Returned by every entry point that can fail; the Python wrapper raises on anything but SPARK_OK. After a
 * failure the call's outputs hold no result (some may be partly written): the caller must not use them. */
enum spark_status {
    SPARK_OK = 0,
    SPARK_ERR_NOMEM = 1,       /* a scratch allocation failed */
    SPARK_ERR_UNSUPPORTED = 2, /* this build or these shapes cannot (a path the build lacks, K not a multiple) */
};

/* How the packed linears multiply (bf16 activations), passed to each call. DOT: AVX512-BF16 dot products;
 * FMA: fp32 FMAs (AVX-512F, or AVX2 in the AVX2 build); PORTABLE: the plain-C loops every build has. */
enum spark_linear_path {
    SPARK_PATH_DOT = 0,
    SPARK_PATH_FMA = 1,
    SPARK_PATH_PORTABLE = 2,
};

/* The instruction-set targets the library is built for (engine/kernels/build.py), lowest first: each runs
 * on a subset of the CPUs the one below it runs on. */
enum spark_target {
    SPARK_TARGET_PORTABLE = 0,   /* x86-64 */
    SPARK_TARGET_AVX2 = 1,       /* x86-64-v3 */
    SPARK_TARGET_AVX512 = 2,     /* x86-64-v4: AVX-512 F/BW/CD/DQ/VL */
    SPARK_TARGET_AVX512BF16 = 3, /* x86-64-v4 plus AVX512-BF16, VNNI and VBMI */
};

#endif

/* Library identity and the CPU's best target (target.h). */
#include "target.h"

#include "layer_ops.h"

#define SPARK_KERNELS_ABI_VERSION 17

int spark_kernels_abi_version(void) { return SPARK_KERNELS_ABI_VERSION; }

/* The build's own target, from the instruction sets its flags enable (engine/kernels/build.py's TARGETS). */
int spark_kernels_target(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
    return SPARK_TARGET_AVX512BF16;
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) \
    && defined(__AVX512CD__)
    return SPARK_TARGET_AVX512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return SPARK_TARGET_AVX2;
#else
    return SPARK_TARGET_PORTABLE;
#endif
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/* Whether this CPU runs a target's library: every extension its -march/-m flags enable (build.py's TARGETS),
 * not only those the kernels' #if paths name, since the compiler may emit any of them anywhere (an
 * instruction the CPU lacks kills the process). tests/engine/test_kernel_targets.py compares each function
 * with what the compiler enables for that target's flags. __builtin_cpu_supports reads cpuid and checks that
 * the operating system saves the registers the extension needs (XCR0), so a kernel or hypervisor that
 * disables the AVX or AVX-512 state is respected. */

/* x86-64-v3: the x86-64-v2 extensions, then AVX, AVX2, BMI1/2, F16C, FMA, LZCNT, MOVBE, XSAVE */
static int cpu_runs_avx2(void) {
    return __builtin_cpu_supports("sse3") && __builtin_cpu_supports("ssse3") && __builtin_cpu_supports("sse4.1")
           && __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt")
           && __builtin_cpu_supports("cmpxchg16b") && __builtin_cpu_supports("lahf_lm")
           && __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi")
           && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma")
           && __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("movbe") && __builtin_cpu_supports("xsave");
}

/* x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Skylake-X, Cascade Lake, Ice Lake, Zen 4 and later) */
static int cpu_runs_avx512(void) {
    return cpu_runs_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
           && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq")
           && __builtin_cpu_supports("avx512vl");
}

/* x86-64-v4 plus BF16, VNNI and VBMI (Cooper Lake, Sapphire Rapids, Zen 4 and later) */
static int cpu_runs_avx512bf16(void) {
    return cpu_runs_avx512() && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni")
           && __builtin_cpu_supports("avx512vbmi");
}
#endif

/* The highest target this CPU runs, as ggml picks its CPU backend variant. */
int spark_cpu_best_target(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return cpu_runs_avx512bf16() ? SPARK_TARGET_AVX512BF16
           : cpu_runs_avx512()   ? SPARK_TARGET_AVX512
           : cpu_runs_avx2()     ? SPARK_TARGET_AVX2
                                 : SPARK_TARGET_PORTABLE;
#else
    return SPARK_TARGET_PORTABLE;
#endif
}

int spark_kernels_max_head_dim(void) { return SPARK_MAX_HEAD_DIM; }
int spark_kernels_max_group(void) { return SPARK_MAX_GROUP; }

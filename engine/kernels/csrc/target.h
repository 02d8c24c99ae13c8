/* What a built library is and what the CPU it runs on can take (target.c). Every target's library has these;
 * the loader asks the portable one which target this CPU can run (as ggml picks its CPU backend variant),
 * then checks the chosen library's own answers. */
#ifndef SPARK_TARGET_H
#define SPARK_TARGET_H

#include <stdint.h>

#include "spark_types.h"

/* The interface version: bumped whenever an entry point's arguments or a struct's fields change, so that the
 * Python bindings refuse a library built from other sources. */
int spark_kernels_abi_version(void);

/* The target this library was compiled for (enum spark_target). */
int spark_kernels_target(void);

/* The highest target this CPU and its operating system can run (enum spark_target), from cpuid. */
int spark_cpu_best_target(void);

/* The attention kernels' largest head size, and most query heads per KV head. */
int spark_kernels_max_head_dim(void);
int spark_kernels_max_group(void);

#endif

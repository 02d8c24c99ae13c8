/* Entry points for benchmarks only (bench.c). The production libraries do not have them: benchmarks/ builds
 * a library of every unit plus this one (engine/kernels/build.py, bench=True). */
#ifndef SPARK_BENCH_H
#define SPARK_BENCH_H

#include <stdint.h>

#include "forward.h"
#include "spark_types.h"

/* The arithmetic ceiling of an instruction on this CPU: `rounds` of 12 independent register-resident
 * instructions a thread. kind 0: vdpbf16ps (32 multiply-adds each), 1: fp32 FMAs (16), 2: vpdpbusd (64).
 * Returns the multiply-adds done, 0 where the build lacks the instruction. */
double spark_bench_dot_peak(int kind, int64_t rounds, int num_threads);

/* spark_forward_layers with the kernel groups in `skip` (enum spark_forward_skip) left out: the time a step
 * takes without them says what they cost in it. Returns SPARK_OK or the first failing kernel's status. */
int spark_bench_forward_layers(const struct spark_layer_desc *layers, int64_t num_layers,
                               const struct spark_forward_step *s, int path, int skip, int num_threads);

#endif

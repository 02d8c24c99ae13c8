/* The packed linear kernels (cpu_linear.h, cpu_linear_fma.h) as their own compilation unit: most of the
 * kernels' compile time, built beside cpu_kernels.c rather than after it (engine/kernels/__init__.py). */

#include "cpu_common.h"

#include "cpu_linear.h"

#include "cpu_greedy_head.h"

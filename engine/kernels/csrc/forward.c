/* The decoder layers of a bf16 forward in one call (forward.h). */
#include "forward.h"

#include "forward_loop.h"

int spark_forward_layers(const struct spark_layer_desc *layers, int64_t num_layers,
                         const struct spark_forward_step *s, int path, int num_threads) {
    return forward_layers_skipping(layers, num_layers, s, path, 0, num_threads);
}

int64_t spark_forward_struct_size(int which) {
    switch (which) {
    case 0: return (int64_t)sizeof(struct spark_linear_desc);
    case 1: return (int64_t)sizeof(struct spark_layer_desc);
    case 2: return (int64_t)sizeof(struct spark_forward_step);
    default: return -1;
    }
}

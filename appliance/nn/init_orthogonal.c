/* init_orthogonal.c - Keras' Orthogonal initialiser (the default of lstm's and
 * gru's recurrent kernels): the tensor seen as a matrix of rows = the product
 * of all but its last dimension by cols = its last, filled with the Q of a QR
 * decomposition of a matrix of standard normals (of shape (rows, cols), or
 * (cols, rows) transposed after when rows < cols), each column's sign chosen so
 * that R's diagonal is positive. Its rows (or columns) are then orthonormal: a
 * recurrent kernel (H, gates H) neither grows nor shrinks the state it
 * multiplies, which is why Keras starts a recurrence there.
 *
 * Modified Gram-Schmidt in double gives that Q directly (R's diagonal is the
 * norm of each column, positive); the normal matrix is well conditioned, so
 * one pass is orthogonal to ~1e-15. A fixed order of operations and no
 * vector intrinsics: the same bits on every CPU, as every initialiser here.
 * Cost m n^2 for m >= n: 67 M multiply-adds for a 256-unit lstm (H, 4H).
 *
 * Threads: the caller's. */
#include <math.h>
#include <stdlib.h>

#include "nn_internal.h"

bool nn_init_orthogonal_(float *p, const loom_shape *shape, loom_rng *r)
{
    int64_t n_all = loom_shape_numel(shape);
    int64_t cols = shape->rank >= 1 ? shape->dim[shape->rank - 1] : 1;
    if (cols < 1 || n_all < 1) return true;
    int64_t rows = n_all / cols;
    int64_t m = rows >= cols ? rows : cols, n = rows >= cols ? cols : rows; /* the QR's (m, n), m >= n */
    double *q = malloc((size_t)(m * n) * sizeof *q);                       /* column-major: column j at q + j m */
    if (!q) return false;
    for (int64_t k = 0; k < m * n; k++) q[k] = loom_rng_normal(r);
    for (int64_t j = 0; j < n; j++) {
        double *v = q + j * m;
        for (int64_t i = 0; i < j; i++) {
            const double *u = q + i * m;
            double d = 0;
            for (int64_t k = 0; k < m; k++) d += u[k] * v[k];
            for (int64_t k = 0; k < m; k++) v[k] -= d * u[k];
        }
        double s = 0;
        for (int64_t k = 0; k < m; k++) s += v[k] * v[k];
        s = s > 0 ? 1.0 / sqrt(s) : 0.0;
        for (int64_t k = 0; k < m; k++) v[k] *= s;
    }
    for (int64_t a = 0; a < rows; a++)
        for (int64_t b = 0; b < cols; b++)
            p[a * cols + b] = (float)(rows >= cols ? q[b * m + a] : q[a * m + b]);
    free(q);
    return true;
}

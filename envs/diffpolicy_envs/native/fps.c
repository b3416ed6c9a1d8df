/* Farthest-point sampling of M points in 3-D: the loop of diffpolicy_envs.meta_world.farthest_points in C.
 *
 * Each next index is the first point whose squared distance to the chosen set is largest, the distances
 * accumulated in the reference's order ((x - xj)^2, then + (y - yj)^2, then + (z - zj)^2, in double, built
 * with -ffp-contract=off), so the indices are the NumPy loop's own. One pass over the M points per choice
 * (a branch-free update the compiler vectorises, then the arg-max), instead of NumPy's eight calls.
 */
#include <math.h>
#include <stdint.h>

void farthest_points(const double *x, const double *y, const double *z, int64_t m, int64_t n, int64_t start,
                     double *dist, int64_t *out) {
    for (int64_t k = 0; k < m; ++k) dist[k] = INFINITY;
    out[0] = start;
    for (int64_t i = 1; i < n; ++i) {
        const int64_t j = out[i - 1];
        const double xj = x[j], yj = y[j], zj = z[j];
        for (int64_t k = 0; k < m; ++k) { /* the update: branch-free, vectorisable */
            double t = x[k] - xj;
            double d2 = t * t;
            t = y[k] - yj;
            d2 += t * t;
            t = z[k] - zj;
            d2 += t * t;
            dist[k] = dist[k] < d2 ? dist[k] : d2;
        }
        double best = dist[0];
        int64_t arg = 0;
        for (int64_t k = 1; k < m; ++k) { /* the first arg-max, as NumPy's */
            if (dist[k] > best) {
                best = dist[k];
                arg = k;
            }
        }
        out[i] = arg;
    }
}

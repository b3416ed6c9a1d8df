/* Farthest-point sampling of M points in 3-D: the loop of diffpolicy_envs.meta_world.farthest_points in C.
 *
 * Each next index is the first point whose squared distance to the chosen set is largest, the distances
 * accumulated in the reference's order ((x - xj)^2, then + (y - yj)^2, then + (z - zj)^2, in double, built
 * with -ffp-contract=off), so the indices are the NumPy loop's own. One pass over the M points per choice
 * updates the distances and their maximum together (two lanes at a time with SSE2, which every x86-64 has;
 * scalar elsewhere), then the first index holding that maximum is the arg-max NumPy returns.
 */
#include <math.h>
#include <stdint.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

void farthest_points(const double *x, const double *y, const double *z, int64_t m, int64_t n, int64_t start,
                     double *dist, int64_t *out) {
    for (int64_t k = 0; k < m; ++k) dist[k] = INFINITY;
    out[0] = start;
    for (int64_t i = 1; i < n; ++i) {
        const int64_t j = out[i - 1];
        const double xj = x[j], yj = y[j], zj = z[j];
        double best = -INFINITY;
        int64_t k = 0;
#if defined(__SSE2__)
        const __m128d vx = _mm_set1_pd(xj), vy = _mm_set1_pd(yj), vz = _mm_set1_pd(zj);
        __m128d vbest = _mm_set1_pd(-INFINITY);
        for (; k + 2 <= m; k += 2) { /* the same operations, in the same order, on two points */
            __m128d t = _mm_sub_pd(_mm_loadu_pd(x + k), vx);
            __m128d d2 = _mm_mul_pd(t, t);
            t = _mm_sub_pd(_mm_loadu_pd(y + k), vy);
            d2 = _mm_add_pd(d2, _mm_mul_pd(t, t));
            t = _mm_sub_pd(_mm_loadu_pd(z + k), vz);
            d2 = _mm_add_pd(d2, _mm_mul_pd(t, t));
            const __m128d d = _mm_min_pd(_mm_loadu_pd(dist + k), d2);
            _mm_storeu_pd(dist + k, d);
            vbest = _mm_max_pd(vbest, d);
        }
        double lanes[2];
        _mm_storeu_pd(lanes, vbest);
        best = lanes[0] > lanes[1] ? lanes[0] : lanes[1];
#endif
        for (; k < m; ++k) { /* the tail (all of it without SSE2) */
            double t = x[k] - xj;
            double d2 = t * t;
            t = y[k] - yj;
            d2 += t * t;
            t = z[k] - zj;
            d2 += t * t;
            dist[k] = dist[k] < d2 ? dist[k] : d2;
            if (dist[k] > best) best = dist[k];
        }
        int64_t arg = 0; /* the first index holding the maximum, as NumPy's arg-max */
        while (arg < m - 1 && dist[arg] != best) ++arg;
        out[i] = arg;
    }
}

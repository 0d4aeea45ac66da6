/* harness.h - a tiny TAP test harness: a table of cases, each a function that
 * records failures with CHECK; prints "ok N - name" / "not ok N - name".
 *   static void test_x(void) { CHECK(1 + 1 == 2); CHECK_NEAR(a, b, 1e-6); }
 *   static const loom_test tests[] = { {"x", test_x}, {0} };
 *   int main(void) { return loom_test_run(tests); }
 * LOOM_TEST_FILTER=substring runs only matching cases. */
#ifndef LOOM_TEST_HARNESS_H
#define LOOM_TEST_HARNESS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct loom_test {
    const char *name;
    void (*fn)(void);
} loom_test;

static int harness_failures_;

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            printf("#   %s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);         \
            harness_failures_++;                                                        \
        }                                                                               \
    } while (0)

#define CHECK_MSG(cond, ...)                                                            \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            printf("#   %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);         \
            printf(__VA_ARGS__);                                                        \
            printf("\n");                                                               \
            harness_failures_++;                                                        \
        }                                                                               \
    } while (0)

#define CHECK_NEAR(a, b, tol)                                                           \
    do {                                                                                \
        double a_ = (double)(a), b_ = (double)(b);                                      \
        if (!(fabs(a_ - b_) <= (tol))) {                                                \
            printf("#   %s:%d: %s = %.9g, %s = %.9g, differ by more than %g\n",         \
                   __FILE__, __LINE__, #a, a_, #b, b_, (double)(tol));                  \
            harness_failures_++;                                                        \
        }                                                                               \
    } while (0)

/* Checks that a string contains a substring. */
#define CHECK_CONTAINS(hay, needle)                                                     \
    do {                                                                                \
        const char *h_ = (hay), *n_ = (needle);                                         \
        if (!h_ || !strstr(h_, n_)) {                                                   \
            printf("#   %s:%d: \"%s\" does not contain \"%s\"\n", __FILE__, __LINE__,   \
                   h_ ? h_ : "(null)", n_);                                             \
            harness_failures_++;                                                        \
        }                                                                               \
    } while (0)

/* Central differences against an analytic gradient (caffe's
 * GradientChecker), for the nn tests: for every stride-th parameter k of
 * p[0..P) that skip (may be NULL) does not take, p[k] moves by +-eps and
 * loss(ctx), the summed loss of a batch of B, gives the numeric gradient
 * (lp - lm) / 2eps / B of the mean loss, compared with ga[k] by relative
 * error (floor 1e-2): over 1e-2 is bad, the first 5 printed. With kinks, a
 * parameter whose second difference shows a kink within eps (ReLU, max
 * pool, MAE at z = t) is skipped and counted: central differences mean
 * nothing there. p ends as it started. The counts go back to the caller,
 * whose CHECKs set the bounds. */
typedef struct harness_gradcheck {
    long long tested, bad, kinks;
    double    worst;
} harness_gradcheck;

static inline harness_gradcheck harness_gradcheck_run(const char *what, float *p, const float *ga, long long P,
                                                      long long stride, float eps, double B, double (*loss)(void *ctx),
                                                      void *ctx, int (*skip)(long long k, void *ctx), int kinks)
{
    harness_gradcheck g = {0, 0, 0, 0};
    const double l0 = kinks ? loss(ctx) : 0;
    for (long long k = 0; k < P; k += stride) {
        if (skip && skip(k, ctx)) continue;
        float p0 = p[k];
        p[k] = p0 + eps;
        double lp = loss(ctx);
        p[k] = p0 - eps;
        double lm = loss(ctx);
        p[k] = p0;
        if (kinks && fabs(lp - 2 * l0 + lm) > 0.05 * fabs(lp - lm) + 1e-5) {
            g.kinks++;
            continue;
        }
        double num = (lp - lm) / (2.0 * eps) / B, an = ga[k];
        double rel = fabs(num - an) / fmax(fmax(fabs(num), fabs(an)), 1e-2);
        g.worst = fmax(g.worst, rel);
        g.tested++;
        if (rel > 1e-2) {
            if (g.bad < 5) printf("#   %s: param %lld: analytic %.6g numeric %.6g\n", what, k, an, num);
            g.bad++;
        }
    }
    printf("# %s: %lld params checked, worst relative error %.2e, %lld skipped at kinks\n", what, g.tested, g.worst,
           g.kinks);
    return g;
}

static inline int loom_test_run(const loom_test *tests)
{
    const char *filter = getenv("LOOM_TEST_FILTER");
    int n = 0, failed = 0;
    for (const loom_test *t = tests; t->name; t++) n++;
    printf("1..%d\n", n);
    int i = 0;
    for (const loom_test *t = tests; t->name; t++) {
        i++;
        if (filter && !strstr(t->name, filter)) {
            printf("ok %d - %s # SKIP filtered\n", i, t->name);
            continue;
        }
        int before = harness_failures_;
        t->fn();
        fflush(stdout);
        if (harness_failures_ != before) {
            printf("not ok %d - %s\n", i, t->name);
            failed++;
        } else {
            printf("ok %d - %s\n", i, t->name);
        }
    }
    return failed ? 1 : 0;
}

#endif

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

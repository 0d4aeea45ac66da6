#include "harness.h"
static void t0(void) { CHECK(1); }
static const loom_test tests[] = {{"placeholder", t0}, {0}};
int main(void) { return loom_test_run(tests); }

/* test_hooks.c - the Lua hooks (script/hooks.h) against a recording host,
 * and the training step in parts (nn.h) against the whole step. The
 * trainer's side runs on real data in tests/integration/hooks.sh. */
#include "harness.h"
#include "nn/nn.h"
#include "script/hooks.h"

#include <math.h>

static loom_err err;

/* ---- a training step in parts ------------------------------------------------ */

static loom_layer_spec layer(loom_layer_kind k)
{
    loom_layer_spec s;
    memset(&s, 0, sizeof s);
    s.kind = k;
    s.use_bias = true;
    snprintf(s.loc.file, sizeof s.loc.file, "test.cfg");
    s.loc.line = 10;
    return s;
}

/* conv (1 -> 4), max pool, flatten, dense 16 relu, dropout 0.3, dense 5 */
static void cnn_spec(loom_model_spec *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->loc.file, sizeof m->loc.file, "test.cfg");
    m->loss = LOOM_LOSS_SPARSE_SOFTMAX_CE;
    loom_layer_spec *l = m->layer;
    l[0] = layer(LOOM_LAYER_CONV2D);
    l[0].filters = 4;
    l[0].kernel[0] = l[0].kernel[1] = 3;
    l[0].activation = LOOM_ACT_RELU;
    l[1] = layer(LOOM_LAYER_MAX_POOL2D);
    l[1].pool[0] = l[1].pool[1] = 2;
    l[2] = layer(LOOM_LAYER_FLATTEN);
    l[3] = layer(LOOM_LAYER_DENSE);
    l[3].units = 16;
    l[3].activation = LOOM_ACT_RELU;
    l[4] = layer(LOOM_LAYER_DROPOUT);
    l[4].rate = 0.3;
    l[5] = layer(LOOM_LAYER_DENSE);
    l[5].units = 5;
    m->n_layers = 6;
}

/* forward + loss + backward give the gradients, loss and count of
 * train_step bit for bit, with 1 and 3 threads (chunked conv gradients),
 * also right after a larger batch (evaluate on 36): with the BLAS row
 * quantum of 12 (OpenBLAS Haswell: any AVX2 CPU) 13 examples make 2 chunks
 * on 3 threads, and the loss and backward took in the larger batch's stale
 * third chunk (a Zen 3 CI run: UBSan's null memcpy in act_grad_to). */
static void test_parts_equal_whole_step(void)
{
    loom_model_spec ms;
    cnn_spec(&ms);
    const int64_t B = 13, BIG = 36;
    loom_shape in = {.rank = 3, .dim = {10, 10, 1}}, lab = {.rank = 0};
    loom_shape xs = {.rank = 4, .dim = {B, 10, 10, 1}}, ys = {.rank = 1, .dim = {B}};
    loom_shape xbs = {.rank = 4, .dim = {BIG, 10, 10, 1}}, ybs = {.rank = 1, .dim = {BIG}};
    loom_tensor x, y, xb, yb;
    CHECK(loom_tensor_init(&x, LOOM_F32, &xs, &err) == 0 && loom_tensor_init(&y, LOOM_U8, &ys, &err) == 0);
    CHECK(loom_tensor_init(&xb, LOOM_F32, &xbs, &err) == 0 && loom_tensor_init(&yb, LOOM_U8, &ybs, &err) == 0);
    loom_rng r;
    loom_rng_init(&r, 7, 1, 2, 3);
    for (int64_t i = 0; i < BIG * 100; i++) ((float *)xb.data)[i] = (float)loom_rng_uniform64(&r);
    for (int64_t i = 0; i < BIG; i++) ((uint8_t *)yb.data)[i] = (uint8_t)(i % 5);
    memcpy(x.data, xb.data, (size_t)B * 100 * sizeof(float));
    memcpy(y.data, yb.data, (size_t)B);
    for (int threads = 1; threads <= 3; threads += 2) {
        loom_model *a = NULL, *b = NULL;
        CHECK(loom_model_new(&a, &ms, &in, LOOM_F32, &lab, LOOM_U8, BIG, &err) == 0);
        CHECK(loom_model_new(&b, &ms, &in, LOOM_F32, &lab, LOOM_U8, BIG, &err) == 0);
        if (!a || !b) return;
        CHECK(loom_model_set_threads(a, threads, &err) == 0 && loom_model_set_threads(b, threads, &err) == 0);
        loom_model_init_params(a, 3);
        loom_model_init_params(b, 3);
        int64_t P = loom_model_num_params(a);
        /* out of order: refused, nothing computed */
        CHECK(loom_model_loss(b, &y, B, NULL, NULL, &err) == LOOM_EUSAGE);
        CHECK(loom_model_backward(b, &err) == LOOM_EUSAGE);
        for (int step = 0; step < 3; step++) {
            double la, lb;
            int64_t ca, cb;
            uint64_t key = loom_rng_mix(11, (uint64_t)step);
            CHECK(loom_model_train_step(a, &x, &y, B, key, &la, &ca, &err) == 0);
            double lbig;
            if (step == 1) CHECK(loom_model_evaluate(b, &xb, &yb, &lbig, NULL, &err) == 0); /* every chunk used */
            CHECK(loom_model_forward(b, &x, key, &err) == 0);
            CHECK(loom_model_backward(b, &err) == LOOM_EUSAGE);
            CHECK(loom_model_loss(b, &y, B, &lb, &cb, &err) == 0);
            CHECK(loom_model_backward(b, &err) == 0);
            CHECK(loom_model_backward(b, &err) == LOOM_EUSAGE); /* once per forward */
            CHECK_MSG(la == lb && ca == cb, "threads %d step %d: loss %.17g vs %.17g", threads, step, la, lb);
            CHECK_MSG(memcmp(loom_model_grads(a), loom_model_grads(b), (size_t)P * sizeof(float)) == 0,
                      "threads %d step %d: gradients differ", threads, step);
            /* an SGD update on both, so the next step starts from new weights */
            for (int64_t i = 0; i < P; i++) {
                loom_model_params(a)[i] -= 0.1f * loom_model_grads(a)[i];
                loom_model_params(b)[i] -= 0.1f * loom_model_grads(b)[i];
            }
        }
        /* a whole step in between discards the parts */
        CHECK(loom_model_forward(b, &x, 1, &err) == 0);
        double l;
        CHECK(loom_model_evaluate(b, &x, &y, &l, NULL, &err) == 0);
        CHECK(loom_model_loss(b, &y, B, NULL, NULL, &err) == LOOM_EUSAGE);
        loom_model_free(a);
        loom_model_free(b);
    }
    loom_tensor_fini(&x);
    loom_tensor_fini(&y);
    loom_tensor_fini(&xb);
    loom_tensor_fini(&yb);
}

/* ---- hooks against a recording host ------------------------------------------ */

typedef struct host_log {
    int     stops;
    double  lr;
    int     saves;
    int     n_scalars;
    char    scalar_name[64][64];
    double  scalar[64];
    int     parts[16], n_parts;
    float   w[4];
} host_log;

static host_log hl;

static void h_stop(void *self) { (void)self; hl.stops++; }
static void h_set_lr(void *self, double lr) { (void)self; hl.lr = lr; }

static int h_save(void *self, char path[LOOM_PATH_MAX], loom_err *e)
{
    (void)self, (void)e;
    hl.saves++;
    snprintf(path, LOOM_PATH_MAX, "ckpt-%d.loom", hl.saves);
    return LOOM_OK;
}

static int h_log(void *self, const char *name, double v, loom_err *e)
{
    (void)self, (void)e;
    if (hl.n_scalars < 64) {
        snprintf(hl.scalar_name[hl.n_scalars], 64, "%s", name);
        hl.scalar[hl.n_scalars++] = v;
    }
    return LOOM_OK;
}

static int h_param(void *self, const char *name, loom_tensor *view, loom_err *e)
{
    (void)self;
    if (strcmp(name, "w")) return loom_err_set(e, LOOM_EUSAGE, NULL, "no parameter \"%s\" (it has: w)", name);
    memset(view, 0, sizeof *view);
    view->dtype = LOOM_F32;
    view->shape.rank = 1;
    view->shape.dim[0] = 4;
    view->data = hl.w;
    return LOOM_OK;
}

static const char *h_param_name(void *self, int i) { (void)self; return i == 0 ? "w" : NULL; }

static int h_step_part(void *self, loom_hook_part part, double *per_replica, loom_err *e)
{
    (void)self, (void)e;
    if (hl.n_parts < 16) hl.parts[hl.n_parts++] = (int)part;
    if (part == LOOM_HOOK_LOSS) per_replica[0] = 6.5;
    return LOOM_OK;
}

static int h_clip(void *self, double max, double *per_replica, loom_err *e)
{
    (void)self, (void)e;
    per_replica[0] = max * 2;
    return LOOM_OK;
}

static const loom_hook_host host = {
    .num_replicas = 1, .stop = h_stop, .set_learning_rate = h_set_lr, .save_checkpoint = h_save,
    .log_scalar = h_log, .param = h_param, .param_name = h_param_name, .step_part = h_step_part,
    .clip_gradients = h_clip,
};

static loom_spec *spec;

/* A spec "as if" loaded from tests/configs/hooks.cfg, whose refs are relative to tests/configs. */
static loom_hook_ref *add_ref(loom_hook_ref *r, const char *fn, int line)
{
    memset(r, 0, sizeof *r);
    snprintf(r->ref, sizeof r->ref, "../lua/test_callbacks.lua:%s", fn);
    snprintf(r->loc.file, sizeof r->loc.file, "tests/configs/hooks.cfg");
    r->loc.line = line;
    return r;
}

static void arg_num(loom_hook_ref *r, const char *name, double v, int type)
{
    snprintf(r->arg_name[r->n_args], LOOM_NAME_MAX, "%s", name);
    r->arg_type[r->n_args] = type;
    r->arg_num[r->n_args++] = v;
}

static void new_spec(void)
{
    free(spec);
    spec = calloc(1, sizeof *spec);
    snprintf(spec->path, sizeof spec->path, "tests/configs/hooks.cfg");
    snprintf(spec->strategy.name, sizeof spec->strategy.name, "one_device");
    spec->hooks.present = true;
    spec->hooks.step_interval = 1;
    memset(&hl, 0, sizeof hl);
    hl.w[1] = 0.25f;
}

static loom_hook_logs logs_at(int64_t step, int64_t epoch)
{
    loom_hook_logs g = {.step = step, .epoch = epoch, .loss = 0.5, .accuracy = NAN, .eval_loss = 0.75,
                        .eval_accuracy = NAN, .samples_per_sec = 100, .learning_rate = 0.1};
    return g;
}

static double scalar(const char *name)
{
    for (int i = hl.n_scalars - 1; i >= 0; i--)
        if (!strcmp(hl.scalar_name[i], name)) return hl.scalar[i];
    return NAN;
}

/* Callbacks see step, epoch and logs, and their ctx methods reach the host. */
static void test_callbacks_reach_the_host(void)
{
    new_spec();
    loom_hook_ref *r = add_ref(&spec->hooks.callback[spec->hooks.n_callbacks++], "recorder", 12);
    arg_num(r, "lr", 0.01, LOOM_HOOK_ARG_NUMBER);
    arg_num(r, "stop_epoch", 2, LOOM_HOOK_ARG_INT);
    arg_num(r, "every", 3, LOOM_HOOK_ARG_INT);
    loom_hooks *h = NULL;
    int rc = loom_hooks_open(&h, spec, "/tmp", &host, &err);
    CHECK_MSG(rc == 0, "%s: %s", err.where, err.msg);
    if (!h) return;
    CHECK(loom_hooks_num_callbacks(h) == 1 && !loom_hooks_has_train_step(h));
    loom_hook_logs g = logs_at(0, 1);
    CHECK(loom_hooks_call(h, LOOM_HOOK_TRAIN_BEGIN, &g, &err) == 0);
    for (int s = 1; s <= 6; s++) {
        g = logs_at(s, 1);
        CHECK(loom_hooks_call(h, LOOM_HOOK_STEP_END, &g, &err) == 0);
    }
    /* step_interval = 3 from the table: steps 3 and 6 */
    CHECK(hl.n_scalars == 2 && scalar("seen/step") == 6);
    g = logs_at(6, 1);
    CHECK(loom_hooks_call(h, LOOM_HOOK_EPOCH_END, &g, &err) == 0);
    CHECK(hl.lr == 0.01 && hl.stops == 0);
    CHECK(scalar("eval/loss") == 0.75 && scalar("w2") == 0.25);
    g = logs_at(12, 2);
    CHECK(loom_hooks_call(h, LOOM_HOOK_EPOCH_END, &g, &err) == 0);
    CHECK(hl.lr == 0.02 && hl.stops == 1);

    /* state: saved, then restored into a fresh set of hooks */
    loom_buf b;
    loom_buf_init(&b);
    CHECK(loom_hooks_save(h, &b, &err) == 0);
    loom_hooks_close(h);
    CHECK(loom_hooks_open(&h, spec, "/tmp", &host, &err) == 0);
    if (!h) return;
    loom_buf rb;
    loom_buf_wrap(&rb, b.data, b.len);
    CHECK(loom_hooks_restore(h, &rb, &err) == 0);
    loom_buf again;
    loom_buf_init(&again);
    CHECK(loom_hooks_save(h, &again, &err) == 0);
    CHECK(again.len == b.len && memcmp(again.data, b.data, b.len) == 0);
    /* a checkpoint of a run without hooks restores nothing */
    loom_buf empty;
    loom_buf_wrap(&empty, b.data, 0);
    CHECK(loom_hooks_restore(h, &empty, &err) == 0);
    /* damaged bytes are refused */
    loom_buf bad;
    loom_buf_wrap(&bad, b.data, b.len - 3);
    CHECK(loom_hooks_restore(h, &bad, &err) == LOOM_ECHECKPOINT);
    loom_buf_fini(&b);
    loom_buf_fini(&again);
    loom_hooks_close(h);
}

/* One callback's additions to ctx.logs reach the next one of the same event. */
static void test_logs_are_shared(void)
{
    new_spec();
    static const char src[] = "return { producer = function(args) return { on_epoch_end = function(ctx) "
                              "ctx.logs.scripted = 41 + ctx.epoch end } end, consumer = function(args) return "
                              "{ on_epoch_end = function(ctx) ctx:log_scalar('got', ctx.logs.scripted) end } end }\n";
    FILE *f = fopen("/tmp/loom_test_shared.lua", "w");
    fputs(src, f);
    fclose(f);
    snprintf(spec->path, sizeof spec->path, "/tmp/hooks.cfg");
    loom_hook_ref *r = &spec->hooks.callback[spec->hooks.n_callbacks++];
    snprintf(r->ref, sizeof r->ref, "loom_test_shared.lua:producer");
    r = &spec->hooks.callback[spec->hooks.n_callbacks++];
    snprintf(r->ref, sizeof r->ref, "loom_test_shared.lua:consumer");
    loom_hooks *h = NULL;
    CHECK_MSG(loom_hooks_open(&h, spec, "/tmp", &host, &err) == 0, "%s: %s", err.where, err.msg);
    if (!h) return;
    loom_hook_logs g = logs_at(5, 1);
    CHECK(loom_hooks_call(h, LOOM_HOOK_EPOCH_END, &g, &err) == 0);
    CHECK(scalar("got") == 42);
    loom_hooks_close(h);
    remove("/tmp/loom_test_shared.lua");
}

/* A runtime error names the Lua file and line, the hook, and has a traceback. */
static void test_error_names_file_and_line(void)
{
    new_spec();
    add_ref(&spec->hooks.callback[spec->hooks.n_callbacks++], "broken", 12);
    loom_hooks *h = NULL;
    CHECK(loom_hooks_open(&h, spec, "/tmp", &host, &err) == 0);
    if (!h) return;
    loom_hook_logs g = logs_at(1, 1);
    CHECK(loom_hooks_call(h, LOOM_HOOK_STEP_END, &g, &err) == LOOM_ELUA);
    CHECK_CONTAINS(err.where, "test_callbacks.lua:25");
    CHECK_CONTAINS(err.msg, "on_step_end");
    CHECK_CONTAINS(err.msg, "attempt to index a nil value");
    CHECK_CONTAINS(err.msg, "traceback");
    /* the state stays usable */
    CHECK(loom_hooks_call(h, LOOM_HOOK_EPOCH_END, &g, &err) == 0);
    loom_hooks_close(h);
}

/* Mistakes found when the hooks are opened (so by loom check). */
static void test_open_errors(void)
{
    loom_hooks *h = NULL;
    new_spec();
    add_ref(&spec->hooks.callback[spec->hooks.n_callbacks++], "no_such_factory", 14);
    CHECK(loom_hooks_open(&h, spec, "/tmp", &host, &err) == LOOM_ECONFIG && !h);
    CHECK_CONTAINS(err.msg, "no_such_factory");
    CHECK_CONTAINS(err.msg, "hooks.callbacks.[0]");
    CHECK_CONTAINS(err.msg, "tests/configs/hooks.cfg:14");

    new_spec();
    add_ref(&spec->hooks.callback[spec->hooks.n_callbacks++], "misspelt", 15);
    CHECK(loom_hooks_open(&h, spec, "/tmp", &host, &err) == LOOM_ECONFIG && !h);
    CHECK_CONTAINS(err.msg, "`on_epoch_ends` is not a callback");
    CHECK_CONTAINS(err.hint, "on_epoch_end");
    CHECK_CONTAINS(err.where, "tests/configs/hooks.cfg:15");

    new_spec();
    add_ref(&spec->hooks.callback[spec->hooks.n_callbacks++], "not_a_table", 16);
    CHECK(loom_hooks_open(&h, spec, "/tmp", &host, &err) == LOOM_ECONFIG && !h);
    CHECK_CONTAINS(err.msg, "returned number, not a table of callbacks");

    new_spec();
    add_ref(&spec->hooks.train_step, "no_such_step", 17);
    spec->hooks.has_train_step = true;
    CHECK(loom_hooks_open(&h, spec, "/tmp", &host, &err) == LOOM_ECONFIG && !h);
    CHECK_CONTAINS(err.msg, "no_such_step");
    CHECK_CONTAINS(err.msg, "hooks.train_step");

    /* a state a checkpoint cannot hold: an error naming the key */
    new_spec();
    add_ref(&spec->hooks.callback[spec->hooks.n_callbacks++], "bad_state", 19);
    CHECK(loom_hooks_open(&h, spec, "/tmp", &host, &err) == 0);
    if (h) {
        loom_buf b;
        loom_buf_init(&b);
        CHECK(loom_hooks_save(h, &b, &err) == LOOM_ELUA);
        CHECK_CONTAINS(err.msg, "state.f is a function");
        loom_buf_fini(&b);
        loom_hooks_close(h);
        h = NULL;
    }

    /* a strategy without step parts cannot run a custom step */
    new_spec();
    add_ref(&spec->hooks.train_step, "good_step", 18);
    spec->hooks.has_train_step = true;
    loom_hook_host partless = host;
    partless.step_part = NULL;
    partless.clip_gradients = NULL;
    CHECK(loom_hooks_open(&h, spec, "/tmp", &partless, &err) == LOOM_ECONFIG && !h);
    CHECK_CONTAINS(err.msg, "cannot run a custom training step");
}

static loom_hooks *open_step(const char *fn)
{
    new_spec();
    loom_hook_ref *r = add_ref(&spec->hooks.train_step, fn, 20);
    arg_num(r, "clip", 1.5, LOOM_HOOK_ARG_NUMBER);
    spec->hooks.has_train_step = true;
    spec->hooks.instruction_limit = 1000000;
    loom_hooks *h = NULL;
    CHECK_MSG(loom_hooks_open(&h, spec, "/tmp", &host, &err) == 0, "%s: %s", err.where, err.msg);
    return h;
}

/* A custom step drives the parts in order, and gets per-replica values. */
static void test_train_step(void)
{
    loom_hooks *h = open_step("good_step");
    if (!h) return;
    loom_elem_spec es = {.n = 1};
    snprintf(es.name[0], sizeof es.name[0], "image");
    es.dtype[0] = LOOM_F32;
    es.shape[0].rank = 1;
    es.shape[0].dim[0] = 2;
    float data[2] = {1, 2};
    loom_elem e = {.n = 1};
    e.t[0].dtype = LOOM_F32;
    e.t[0].shape = es.shape[0];
    e.t[0].data = data;
    bool applied = false;
    loom_hook_logs g = logs_at(3, 1);
    int rc = loom_hooks_train_step(h, &es, &e, &g, &applied, &err);
    CHECK_MSG(rc == 0, "%s: %s", err.where, err.msg);
    CHECK(applied);
    CHECK(hl.n_parts == 5);
    for (int i = 0; i < 5 && i < hl.n_parts; i++) CHECK(hl.parts[i] == i);
    CHECK(scalar("loss_sum") == 6.5 && scalar("loss_mean") == 6.5 && scalar("norm") == 3.0);
    CHECK(scalar("reduced_number") == 2.5);
    loom_hooks_close(h);

    /* out of order: a Lua error at the caller's line, nothing run */
    h = open_step("loss_first");
    if (!h) return;
    CHECK(loom_hooks_train_step(h, &es, &e, &g, &applied, &err) == LOOM_ELUA);
    CHECK_CONTAINS(err.where, "test_callbacks.lua:52");
    CHECK_CONTAINS(err.msg, "ctx:loss() needs ctx:forward() just before it");
    CHECK(hl.n_parts == 0 && !applied);
    loom_hooks_close(h);

    h = open_step("no_reduce");
    if (!h) return;
    CHECK(loom_hooks_train_step(h, &es, &e, &g, &applied, &err) == LOOM_ELUA);
    CHECK_CONTAINS(err.where, "test_callbacks.lua:58");
    CHECK_CONTAINS(err.msg, "all_reduce_gradients");
    CHECK(!applied);
    loom_hooks_close(h);

    /* a step that never returns is stopped by the instruction budget */
    h = open_step("forever");
    if (!h) return;
    CHECK(loom_hooks_train_step(h, &es, &e, &g, &applied, &err) == LOOM_ELUA);
    CHECK_CONTAINS(err.msg, "instruction");
    loom_hooks_close(h);
}

static const loom_test tests[] = {
    {"parts_equal_whole_step", test_parts_equal_whole_step},
    {"callbacks_reach_the_host", test_callbacks_reach_the_host},
    {"logs_are_shared", test_logs_are_shared},
    {"error_names_file_and_line", test_error_names_file_and_line},
    {"open_errors", test_open_errors},
    {"train_step", test_train_step},
    {0},
};

int main(void)
{
    if (loom_blas_init(1, &err)) {
        printf("Bail out! %s\n", err.msg);
        return 1;
    }
    int rc = loom_test_run(tests);
    free(spec);
    return rc;
}

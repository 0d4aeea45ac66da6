/* test_attention.c - multi_head_attention and positional_embedding (attention.c)
 * against PyTorch: the forward output, the input gradient and every parameter
 * gradient of a train step under a mean squared error, with and without the
 * causal mask, compared with numbers computed once in float64 by
 * tests/fixtures/attention_torch.py (Keras's layouts as einsums); the
 * sinusoidal table; a learned table's gradient; dropout's masks the same for
 * any number of threads. */
#include "harness.h"
#include "nn/nn.h"
#include "nn/nn_internal.h" /* white box: the input gradient of the step (as gradcheck.c reads it) */

#include <math.h>
#include <string.h>

enum { B = 2, T = 4, D = 6, H = 2, DK = 3, DV = 2 };

/* ---- the numbers from tests/fixtures/attention_torch.py ---- */
static const double want_y_full[48] = {
    0.596422995, 0.694090773, 0.697816621, 0.607096262, 0.434208273, 0.202552231,
    0.596376568, 0.69422732, 0.698117661, 0.607521052, 0.434699319, 0.203043072,
    0.596438752, 0.694089149, 0.697797836, 0.607062859, 0.434164772, 0.20250452,
    0.596420594, 0.694126822, 0.697886241, 0.607190031, 0.434313499, 0.202654672,
    0.573659469, 0.668386904, 0.672651307, 0.585875512, 0.419804214, 0.196914385,
    0.573811429, 0.668325206, 0.672384303, 0.585439338, 0.419257905, 0.196331882,
    0.573726927, 0.668368095, 0.672548778, 0.585703138, 0.419585326, 0.196678609,
    0.573694054, 0.668392669, 0.672627473, 0.585825303, 0.419734427, 0.196834465,
};
static const double want_dx_full[48] = {
    0.0183136609, 0.00567228059, -0.0159742322, -0.00851380514, 0.0130526552, 0.0124912514,
    0.0176475867, 0.00951482777, -0.0175452441, -0.0122438497, 0.0164006628, 0.0134646055,
    0.0150777714, 0.00732584337, -0.0149114223, -0.0105150044, 0.014753247, 0.011561181,
    0.0189240834, 0.00603440378, -0.0165305621, -0.00877794926, 0.0133322109, 0.0128839573,
    0.0243827525, 0.0123460303, -0.0237253349, -0.0163791931, 0.022010959, 0.0185829749,
    0.0221786214, 0.00768666367, -0.0202276218, -0.0120647525, 0.0183410844, 0.0157363982,
    0.0279533087, 0.00785028665, -0.0237476329, -0.011296857, 0.0178772328, 0.0182998152,
    0.0231325559, 0.0121829687, -0.0229154845, -0.0164628313, 0.0220725736, 0.0179993162,
};
static const double want_g0_full[36] = {
    6.08410143e-05, 5.55427492e-05, 4.27270335e-05, -5.352863e-05, -8.80574557e-06, 3.71089552e-05,
    3.12557001e-05, 2.20739086e-05, 9.90451713e-06, -4.36889714e-06, 8.11929213e-06, 1.95085733e-05,
    -2.55992651e-06, -1.4382532e-05, -2.42585292e-05, 4.53821455e-05, 2.39454217e-05, -7.3220251e-07,
    -3.60290791e-05, -4.88923643e-05, -5.51382973e-05, 8.89909276e-05, 3.65306508e-05, -2.08738781e-05,
    -6.46218648e-05, -7.67848444e-05, -7.85553556e-05, 0.000120555205, 4.41716277e-05, -3.81903723e-05,
    -8.44683842e-05, -9.42848561e-05, -9.13403151e-05, 0.000135802901, 4.5834182e-05, -5.03379787e-05,
};
static const double want_g1_full[6] = {
    0.000405796101, 0.0004644996, 0.000460335256, -0.000612000652, -0.000211860991, 0.000216953061,
};
static const double want_g2_full[36] = {
    0.000408652837, 0.000749465261, 0.000988841077, 0.000561226452, 0.000515665595, 0.000400311818,
    0.000431761106, 0.000813074873, 0.00108434277, 0.00163155804, 0.00151414912, 0.00119180722,
    0.000396432534, 0.000766638616, 0.00103308376, 0.0024810659, 0.00230769966, 0.0018219971,
    0.000307448679, 0.000616441419, 0.000842001704, 0.00299477313, 0.00278891388, 0.00220558823,
    0.000176853088, 0.000382811767, 0.000536958669, 0.00310315187, 0.00289266169, 0.00229066333,
    2.23212606e-05, 9.73703386e-05, 0.000159240798, 0.00279153356, 0.00260490131, 0.0020657079,
};
static const double want_g3_full[6] = {
    6.77626358e-20, 1.35525272e-19, 5.42101086e-20, 1.08420217e-19, 2.16840434e-19, 2.16840434e-19,
};
static const double want_g4_full[24] = {
    0.0275915813, -0.0192791092, -0.00398262888, 0.0208950841, 0.0183042108, -0.0128398865,
    -0.00274039952, 0.014911966, 0.00653945123, -0.00466284552, -0.00112726993, 0.00691058332,
    -0.00611039237, 0.00414528977, 0.000638430344, -0.00202611443, -0.017933223, 0.0123923795,
    0.00231772207, -0.0106885871, -0.0273288761, 0.0189622189, 0.00368332099, -0.0179044097,
};
static const double want_g5_full[4] = {
    0.457441002, -0.309693997, -0.0829885841, 0.410035871,
};
static const double want_g6_full[24] = {
    0.0662304303, 0.0789700598, 0.0810214621, 0.0721069896, 0.0534331744, 0.0275274297,
    0.0856831961, 0.102139452, 0.104771611, 0.0932234251, 0.0690578856, 0.0355456853,
    0.0939262351, 0.111978044, 0.11487415, 0.102222578, 0.0757356601, 0.0389982759,
    0.0891544998, 0.10628102, 0.109022902, 0.0970090463, 0.071865471, 0.0369952415,
};
static const double want_g7_full[6] = {
    0.188673644, 0.22486903, 0.230629447, 0.20517525, 0.151951546, 0.0781619125,
};
static const double want_y_causal[48] = {
    0.629047734, 0.731048126, 0.734104584, 0.63780343, 0.455178573, 0.210947433,
    0.598445588, 0.696597507, 0.700468222, 0.609533849, 0.436101928, 0.203645658,
    0.583710074, 0.67982346, 0.68392593, 0.595462234, 0.426405518, 0.199636815,
    0.596420594, 0.694126822, 0.697886241, 0.607190031, 0.434313499, 0.202654672,
    0.556709528, 0.648079145, 0.65173429, 0.567180256, 0.405861036, 0.189610428,
    0.560002105, 0.653154475, 0.657905451, 0.57361201, 0.411682875, 0.194034394,
    0.585027418, 0.681094174, 0.68497803, 0.596153322, 0.426642059, 0.199386795,
    0.573694054, 0.668392669, 0.672627473, 0.585825303, 0.419734427, 0.196834465,
};
static const double want_dx_causal[48] = {
    0.0342663943, 0.010539919, -0.0301459413, -0.0160896127, 0.0251193607, 0.0232775754,
    0.025312718, 0.0136393796, -0.0252243008, -0.0179986216, 0.0240853892, 0.019581962,
    0.0083631822, 0.00416853071, -0.0079563559, -0.00568902041, 0.00736769603, 0.00656712057,
    0.00250190907, 0.000616224261, -0.00218500424, -0.000987195331, 0.00177027865, 0.00156794996,
    0.0546260817, 0.023939937, -0.0515101529, -0.0330820564, 0.0464958728, 0.0401239898,
    0.0187671101, 0.00741561502, -0.017203193, -0.0108542019, 0.0154012997, 0.0137647807,
    0.0151868198, 0.00388765183, -0.0129142021, -0.00577967453, 0.00975452612, 0.00965182148,
    0.00839153493, 0.00451225671, -0.00833540719, -0.0060728933, 0.0080555954, 0.00658954915,
};
static const double want_g0_causal[36] = {
    -1.61688869e-05, -2.23449408e-05, -2.54967118e-05, -8.93393263e-05, -3.54191584e-05, 2.32948264e-05,
    -2.18542829e-05, -2.97549447e-05, -3.36284144e-05, -1.97329995e-05, -2.55520843e-06, 1.49684182e-05,
    -2.45818041e-05, -3.31377564e-05, -3.72086688e-05, 5.25440961e-05, 3.0654577e-05, 4.61610474e-06,
    -2.39822936e-05, -3.20355282e-05, -3.57529044e-05, 0.000117709595, 5.97154093e-05, -6.36097679e-06,
    -2.01368921e-05, -2.65974416e-05, -2.94581522e-05, 0.000166943652, 8.06940411e-05, -1.647713e-05,
    -1.35660567e-05, -1.7559516e-05, -1.91763772e-05, 0.000193582669, 9.07511129e-05, -2.43631809e-05,
};
static const double want_g1_causal[6] = {
    0.000341672288, 0.000372838829, 0.000353543384, -0.00075923406, -0.000337718921, 0.000129504889,
};
static const double want_g2_causal[36] = {
    0.000179234672, 0.000360431366, 0.000492845364, -0.000210216051, -0.000193339805, -0.000150295923,
    0.000176559431, 0.000357257617, 0.000489602659, 0.000650085344, 0.00060966099, 0.000486721881,
    0.0001499877, 0.000305730725, 0.000420094531, 0.00142240074, 0.00133014703, 0.00105786416,
    0.000103115836, 0.000212824614, 0.000293728579, 0.00200220086, 0.00187060391, 0.00148582949,
    4.22877284e-05, 9.11136903e-05, 0.000127607842, 0.0023110125, 0.00215788333, 0.00171269477,
    -2.42638253e-05, -4.29290443e-05, -5.57840184e-05, 0.00230703943, 0.00215310336, 0.00170775484,
};
static const double want_g3_causal[6] = {
    9.16913165e-20, 1.20278679e-19, 1.49924832e-19, 6.01732206e-18, 5.31259065e-18, 4.22838847e-18,
};
static const double want_g4_causal[24] = {
    0.0472495633, -0.0389409314, -1.65169209e-05, 0.0367510118, 0.0258516736, -0.0246526768,
    0.00393754226, 0.0194592128, 0.000954881039, -0.00702779801, 0.00735867358, -0.000466299432,
    -0.0240711502, 0.0115482603, 0.00978384294, -0.0203287002, -0.0458392641, 0.0285613157,
    0.0108848151, -0.0374397067, -0.0614032487, 0.0417087311, 0.0105125785, -0.0494834246,
};
static const double want_g5_causal[4] = {
    0.457580155, -0.309738262, -0.0830742147, 0.410183673,
};
static const double want_g6_causal[24] = {
    0.0638505544, 0.077090713, 0.0798970053, 0.0718896127, 0.0541522983, 0.0290857243,
    0.0826769633, 0.0994745073, 0.102808643, 0.0922281119, 0.0691649381, 0.0367406144,
    0.0906786622, 0.108881298, 0.11234736, 0.100607734, 0.0752513239, 0.0397099997,
    0.0861010023, 0.103145844, 0.10623038, 0.0949371318, 0.0707945884, 0.0370703297,
};
static const double want_g7_causal[6] = {
    0.188778074, 0.224965256, 0.230704447, 0.205218872, 0.151957887, 0.0781301136,
};
static const double want_sinusoids[24] = {
    0, 1, 0, 1, 0, 1,
    0.841470985, 0.540302306, 0.0463992235, 0.998922976, 0.00215443302, 0.999997679,
    0.909297427, -0.416146837, 0.0926985008, 0.995694224, 0.00430885605, 0.999990717,
    0.141120008, -0.989992497, 0.138798101, 0.990320699, 0.00646325907, 0.999979113,
};

static const double want_y_cross[48] = {
    0.588594137, 0.68487195, 0.688455558, 0.598859935, 0.42821143, 0.199606516,
    0.591673952, 0.687769377, 0.690778444, 0.600293889, 0.428562372, 0.198826949,
    0.588319072, 0.684532368, 0.68809742, 0.598531714, 0.427957548, 0.199461336,
    0.589306138, 0.685558519, 0.689023771, 0.599232888, 0.428338644, 0.199470774,
    0.592517959, 0.688778817, 0.691816693, 0.601220426, 0.429251794, 0.199185946,
    0.590746458, 0.687025479, 0.690318825, 0.600180757, 0.428811038, 0.199403757,
    0.591766554, 0.688061834, 0.691231172, 0.600845614, 0.429138421, 0.199349356,
    0.592299913, 0.688558094, 0.691623167, 0.601080289, 0.429184014, 0.199199696,
};
static const double want_dv_cross[15] = {
    0.0582791791, 0.0229702432, -0.0541136806, -0.0327833938, 0.0481686335, 0.058526251,
    0.0237466178, -0.0542199622, -0.0335790419, 0.0481306297, 0.0519393583, 0.0221402679,
    -0.0479243702, -0.0308310289, 0.0423333713,
};
static const double want_dk_cross[12] = {
    0.00223589386, -0.00292244842, 0.0012976518, 0.00135345174, 0.00163345848, 0.00128866049,
    -0.00319158373, 0.00257029789, -0.00386935234, 0.00163378793, 0.00189393193, -0.00392374963,
};
static const double want_g0_cross[36] = {
    -4.84010145e-05, -7.20885871e-05, -8.60193077e-05, 0.000162333671, 0.000146474978, 0.000110791584,
    -0.000118650079, -0.000168798007, -0.000196099917, 0.000156031825, 0.000134056431, 9.39371279e-05,
    -0.000172840412, -0.000242661408, -0.000279639322, 0.000128611802, 0.000103493974, 6.43687223e-05,
    -0.000203637605, -0.000283681727, -0.000325330857, 8.37847756e-05, 5.89240937e-05, 2.60883121e-05,
    -0.000206873405, -0.000286307054, -0.000326990387, 2.76178728e-05, 6.37911363e-06, -1.57230287e-05,
    -0.000182109859, -0.000250182065, -0.000284393301, -3.22869795e-05, -4.70292496e-05, -5.54063313e-05,
};
static const double want_g1_cross[6] = {
    0.00102834077, 0.00139362747, 0.00157029324, 0.000330117049, 0.000358313634, 0.000338014149,
};
static const double want_g2_cross[24] = {
    0.00087715, 0.00158399155, 0.00207644728, -0.000458588923, -0.000433952019, -0.000350581746,
    0.000847486648, 0.00153249214, 0.00201008201, 0.000181817627, 0.000163343979, 0.00012276249,
    0.000703119954, 0.00127357711, 0.00167166157, 0.000797616014, 0.000738532137, 0.000579491399,
    0.000463589273, 0.000842289389, 0.00110698959, 0.00130546082, 0.00121376343, 0.000957788866,
};
static const double want_g3_cross[6] = {
    1.62630326e-19, -2.16840434e-19, 0, -1.68051337e-18, -1.73472348e-18, -1.13841228e-18,
};
static const double want_g4_cross[20] = {
    0.0242811669, -0.0168572742, -0.00474575846, 0.0251465032, 0.011440063, -0.00810979661,
    -0.00248275373, 0.013893654, -0.00294939983, 0.00173530394, 0.00011628007, 0.000760363966,
    -0.0169396752, 0.0113455392, 0.00269957591, -0.0124758378, -0.028637245, 0.019420209,
    0.00491749682, -0.0240234935,
};
static const double want_g5_cross[4] = {
    0.460591916, -0.311230706, -0.0842814563, 0.413135797,
};
static const double want_g6_cross[24] = {
    0.0730126682, 0.0869926546, 0.0891985932, 0.0793319208, 0.058728045, 0.0301756039,
    0.0914641447, 0.108933487, 0.111659192, 0.0992723503, 0.0734494612, 0.0376855321,
    0.0978817204, 0.116527405, 0.119401651, 0.106115444, 0.07846701, 0.040198434,
    0.0906329457, 0.107877943, 0.110522167, 0.0982077347, 0.0726013457, 0.0371687052,
};
static const double want_g7_cross[6] = {
    0.190535036, 0.226750259, 0.232275898, 0.206364084, 0.152521859, 0.0780365165,
};

static loom_err err;

/* the fixture's fill: element i of tensor k */
static float val(int64_t i, int k) { return (float)(sin(0.37 * (double)i + 0.11 * k) * 0.5); }
static void fill(float *p, int64_t n, int k)
{
    for (int64_t i = 0; i < n; i++) p[i] = val(i, k);
}

static loom_model_spec spec;

static loom_layer_spec *layer(int i, loom_layer_kind k, const char *name)
{
    loom_layer_spec *l = &spec.layer[i];
    memset(l, 0, sizeof *l);
    l->kind = k;
    l->use_bias = true;
    snprintf(l->name, sizeof l->name, "%s", name);
    snprintf(l->loc.file, sizeof l->loc.file, "test.cfg");
    l->loc.line = 10 + i;
    spec.n_layers = i + 1 > spec.n_layers ? i + 1 : spec.n_layers;
    return l;
}

static void spec_reset(loom_loss_kind loss)
{
    memset(&spec, 0, sizeof spec);
    snprintf(spec.loc.file, sizeof spec.loc.file, "test.cfg");
    spec.loc.line = 5;
    spec.loss = loss;
    snprintf(spec.input, sizeof spec.input, "x");
    snprintf(spec.label, sizeof spec.label, "y");
}

static void check_near(const char *what, const float *got, const double *want, int64_t n, double tol)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(got[i] - want[i]) <= tol + tol * fabs(want[i]))) {
            if (bad++ < 4) printf("#   %s[%lld] = %.9g, torch %.9g\n", what, (long long)i, got[i], want[i]);
        }
    CHECK_MSG(bad == 0, "%s: %d of %lld elements off", what, bad, (long long)n);
}

static void torch_case(bool causal, const double *wy, const double *wdx, const double *const *wg)
{
    spec_reset(LOOM_LOSS_MSE);
    loom_layer_spec *l = layer(0, LOOM_LAYER_MULTI_HEAD_ATTENTION, "mha");
    l->num_heads = H, l->key_dim = DK, l->value_dim = DV, l->causal = causal;
    loom_shape in = {.rank = 2, .dim = {T, D}};
    loom_model *m = NULL;
    int rc = loom_model_new(&m, &spec, &in, LOOM_F32, &in, LOOM_F32, B, &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    if (rc) return;
    CHECK(loom_model_num_param_tensors(m) == 8);
    CHECK(loom_model_num_params(m) == 2 * (D * H * DK + H * DK) + D * H * DV + H * DV + H * DV * D + D);
    float *P = loom_model_params(m);
    for (int t = 0; t < loom_model_num_param_tensors(m); t++) {
        const loom_param_info *p = loom_model_param_tensor(m, t);
        fill(P + p->offset, loom_shape_numel(&p->shape), 2 + t);
    }
    CHECK(!strcmp(loom_model_param_tensor(m, 0)->name, "mha/query/kernel"));
    CHECK(!strcmp(loom_model_param_tensor(m, 7)->name, "mha/attention_output/bias"));
    float x[B * T * D], y[B * T * D];
    fill(x, B * T * D, 1);
    fill(y, B * T * D, 10);
    loom_shape bs = {.rank = 3, .dim = {B, T, D}};
    loom_tensor xt = {.dtype = LOOM_F32, .shape = bs, .data = x}, yt = {.dtype = LOOM_F32, .shape = bs, .data = y};
    m->layer[0].needs_dx = 1;
    double loss;
    int64_t ok;
    CHECK(loom_model_forward(m, &xt, 1, &err) == LOOM_OK);
    check_near("y", m->chunk[0].act[1], wy, B * T * D, 1e-5);
    CHECK(loom_model_loss(m, &yt, B, &loss, &ok, &err) == LOOM_OK);
    CHECK(loom_model_backward(m, &err) == LOOM_OK);
    check_near("dx", m->chunk[0].g, wdx, B * T * D, 1e-5);
    const char *names[8] = {"d query/kernel", "d query/bias", "d key/kernel", "d key/bias", "d value/kernel",
                            "d value/bias", "d output/kernel", "d output/bias"};
    for (int t = 0; t < 8; t++) {
        const loom_param_info *p = loom_model_param_tensor(m, t);
        check_near(names[t], loom_model_grads(m) + p->offset, wg[t], loom_shape_numel(&p->shape), 1e-5);
    }
    loom_model_free(m);
}

static void test_torch_full(void)
{
    const double *g[8] = {want_g0_full, want_g1_full, want_g2_full, want_g3_full,
                          want_g4_full, want_g5_full, want_g6_full, want_g7_full};
    torch_case(false, want_y_full, want_dx_full, g);
}

static void test_torch_causal(void)
{
    const double *g[8] = {want_g0_causal, want_g1_causal, want_g2_causal, want_g3_causal,
                          want_g4_causal, want_g5_causal, want_g6_causal, want_g7_causal};
    torch_case(true, want_y_causal, want_dx_causal, g);
}

/* The first output step of a causal layer sees the first input step alone: changing later steps leaves it. */
static void test_causal_prefix(void)
{
    spec_reset(LOOM_LOSS_MSE);
    loom_layer_spec *l = layer(0, LOOM_LAYER_MULTI_HEAD_ATTENTION, "mha");
    l->num_heads = H, l->key_dim = DK, l->causal = true;
    loom_shape in = {.rank = 2, .dim = {T, D}};
    loom_model *m = NULL;
    CHECK(loom_model_new(&m, &spec, &in, LOOM_F32, &in, LOOM_F32, 1, &err) == LOOM_OK);
    if (!m) return;
    loom_model_init_params(m, 3);
    float x[T * D], a[T * D], b[T * D];
    fill(x, T * D, 1);
    loom_shape bs = {.rank = 3, .dim = {1, T, D}};
    loom_tensor xt = {.dtype = LOOM_F32, .shape = bs, .data = x};
    CHECK(loom_model_predict(m, &xt, a, &err) == LOOM_OK);
    for (int e = 2 * D; e < T * D; e++) x[e] += 1.f;
    CHECK(loom_model_predict(m, &xt, b, &err) == LOOM_OK);
    CHECK(!memcmp(a, b, 2 * D * sizeof(float)));   /* steps 0 and 1 see steps <= 1 only */
    CHECK(memcmp(a + 2 * D, b + 2 * D, D * sizeof(float)) != 0);
    loom_model_free(m);
}

static void test_sinusoidal(void)
{
    spec_reset(LOOM_LOSS_MSE);
    loom_layer_spec *l = layer(0, LOOM_LAYER_POSITIONAL_EMBEDDING, "pos");
    l->max_length = 16, l->pos_mode = LOOM_POS_SINUSOIDAL;
    loom_shape in = {.rank = 2, .dim = {T, D}};
    loom_model *m = NULL;
    CHECK(loom_model_new(&m, &spec, &in, LOOM_F32, &in, LOOM_F32, 1, &err) == LOOM_OK);
    if (!m) return;
    CHECK(loom_model_num_params(m) == 0);
    float x[T * D] = {0}, y[T * D];
    loom_shape bs = {.rank = 3, .dim = {1, T, D}};
    loom_tensor xt = {.dtype = LOOM_F32, .shape = bs, .data = x};
    CHECK(loom_model_predict(m, &xt, y, &err) == LOOM_OK);
    check_near("sinusoids", y, want_sinusoids, T * D, 1e-6);
    loom_model_free(m);
}

/* A learned table: d table[t] = the sum over the batch of d y[t]; rows past T get none. */
static void test_learned_grad(void)
{
    spec_reset(LOOM_LOSS_MSE);
    loom_layer_spec *l = layer(0, LOOM_LAYER_POSITIONAL_EMBEDDING, "pos");
    l->max_length = T + 2;
    loom_shape in = {.rank = 2, .dim = {T, D}};
    loom_model *m = NULL;
    CHECK(loom_model_new(&m, &spec, &in, LOOM_F32, &in, LOOM_F32, B, &err) == LOOM_OK);
    if (!m) return;
    CHECK(loom_model_num_params(m) == (T + 2) * D);
    fill(loom_model_params(m), (T + 2) * D, 4);
    float x[B * T * D], y[B * T * D];
    fill(x, B * T * D, 1);
    fill(y, B * T * D, 10);
    loom_shape bs = {.rank = 3, .dim = {B, T, D}};
    loom_tensor xt = {.dtype = LOOM_F32, .shape = bs, .data = x}, yt = {.dtype = LOOM_F32, .shape = bs, .data = y};
    double loss;
    int64_t ok;
    CHECK(loom_model_train_step(m, &xt, &yt, B, 1, &loss, &ok, &err) == LOOM_OK);
    const float *G = loom_model_grads(m), *W = loom_model_params(m);
    for (int e = 0; e < (T + 2) * D; e++) {
        double want = 0;
        for (int b = 0; e < T * D && b < B; b++) want += 2.0 / (T * D) / B * (x[b * T * D + e] + W[e] - y[b * T * D + e]);
        CHECK_NEAR(G[e], want, 1e-6);
    }
    loom_model_free(m);
}

/* A bad shape is an error naming the layer, with what to do. */
static void test_needs_sequence(void)
{
    spec_reset(LOOM_LOSS_MSE);
    loom_layer_spec *l = layer(0, LOOM_LAYER_MULTI_HEAD_ATTENTION, "mha");
    l->num_heads = 2, l->key_dim = 4;
    loom_shape in = {.rank = 1, .dim = {12}};
    loom_model *m = NULL;
    CHECK(loom_model_new(&m, &spec, &in, LOOM_F32, &in, LOOM_F32, 1, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "layer \"mha\" (multi_head_attention) needs a (T, D) sequence per example, got (12,)");
    CHECK_CONTAINS(err.where, "test.cfg:10");
    spec_reset(LOOM_LOSS_MSE);
    l = layer(0, LOOM_LAYER_POSITIONAL_EMBEDDING, "pos");
    l->max_length = T - 1;
    in = (loom_shape){.rank = 2, .dim = {T, D}};
    CHECK(loom_model_new(&m, &spec, &in, LOOM_F32, &in, LOOM_F32, 1, &err) == LOOM_ESHAPE);
    CHECK_CONTAINS(err.msg, "sequences of 4 steps, max_length = 3");
    CHECK_CONTAINS(err.hint, "set max_length >= 4");
}

/* Dropout on the attention weights: a train step's gradients are the same bits for 1 and 2 threads. */
static void test_dropout_threads(void)
{
    float g[2][4096];
    int64_t np = 0;
    for (int th = 1; th <= 2; th++) {
        spec_reset(LOOM_LOSS_MSE);
        loom_layer_spec *l = layer(0, LOOM_LAYER_MULTI_HEAD_ATTENTION, "mha");
        l->num_heads = H, l->key_dim = DK, l->rate = 0.3, l->causal = true;
        loom_shape in = {.rank = 2, .dim = {T, D}};
        loom_model *m = NULL;
        CHECK(loom_model_new(&m, &spec, &in, LOOM_F32, &in, LOOM_F32, 4, &err) == LOOM_OK);
        if (!m) return;
        CHECK(loom_model_set_threads(m, th, &err) == LOOM_OK);
        loom_model_init_params(m, 5);
        float x[4 * T * D], y[4 * T * D];
        fill(x, 4 * T * D, 1);
        fill(y, 4 * T * D, 10);
        loom_shape bs = {.rank = 3, .dim = {4, T, D}};
        loom_tensor xt = {.dtype = LOOM_F32, .shape = bs, .data = x}, yt = {.dtype = LOOM_F32, .shape = bs, .data = y};
        double loss;
        int64_t ok;
        CHECK(loom_model_train_step(m, &xt, &yt, 4, 77, &loss, &ok, &err) == LOOM_OK);
        np = loom_model_num_params(m);
        LOOM_ASSERT(np <= 4096);
        memcpy(g[th - 1], loom_model_grads(m), (size_t)np * sizeof(float));
        loom_model_free(m);
    }
    CHECK(!memcmp(g[0], g[1], (size_t)np * sizeof(float)));
}

/* An embedding's mask_zero masks the padding keys: the real steps' outputs do not depend on what the padding
 * steps hold (here the table's row 0), as Keras's MultiHeadAttention with the embedding's mask. */
static void test_key_padding(void)
{
    spec_reset(LOOM_LOSS_MSE);
    loom_layer_spec *e = layer(0, LOOM_LAYER_EMBEDDING, "emb");
    e->input_dim = 10, e->output_dim = D, e->mask_zero = true;
    loom_layer_spec *l = layer(1, LOOM_LAYER_MULTI_HEAD_ATTENTION, "mha");
    l->num_heads = H, l->key_dim = DK;
    loom_shape in = {.rank = 1, .dim = {T}}, out = {.rank = 2, .dim = {T, D}};
    loom_model *m = NULL;
    int rc = loom_model_new(&m, &spec, &in, LOOM_I64, &out, LOOM_F32, 2, &err);
    CHECK_MSG(rc == LOOM_OK, "%s", err.msg);
    if (rc) return;
    loom_model_init_params(m, 9);
    int64_t ids[2 * T] = {3, 5, 0, 0, 4, 4, 6, 0};
    float a[2 * T * D], b[2 * T * D];
    loom_shape bs = {.rank = 2, .dim = {2, T}};
    loom_tensor xt = {.dtype = LOOM_I64, .shape = bs, .data = ids};
    CHECK(loom_model_predict(m, &xt, a, &err) == LOOM_OK);
    float *row0 = loom_model_params(m) + loom_model_param_tensor(m, 0)->offset;
    for (int d = 0; d < D; d++) row0[d] += 3.f;
    CHECK(loom_model_predict(m, &xt, b, &err) == LOOM_OK);
    CHECK(!memcmp(a, b, 2 * D * sizeof(float)));                 /* example 0, steps 0 and 1 */
    CHECK(!memcmp(a + T * D, b + T * D, 3 * D * sizeof(float))); /* example 1, steps 0 to 2 */
    loom_model_free(m);
}

/* inputs = [query, value, key] (a graph's layer; value 5 and key 4 wide, 3 steps): against PyTorch. The value's and
 * key's input gradients reach the learned position tables (zeros) before them as their sums over the batch. */
static void test_torch_cross(void)
{
    enum { S = 3, DVI = 5, DKI = 4 };
    spec_reset(LOOM_LOSS_MSE);
    spec.n_inputs = 3;
    snprintf(spec.inputs[0], LOOM_NAME_MAX, "q");
    snprintf(spec.inputs[1], LOOM_NAME_MAX, "v");
    snprintf(spec.inputs[2], LOOM_NAME_MAX, "k");
    loom_layer_spec *pv = layer(0, LOOM_LAYER_POSITIONAL_EMBEDDING, "pv"), *pk;
    pv->max_length = S, pv->n_inputs = 1;
    snprintf(pv->inputs[0], LOOM_NAME_MAX, "v");
    pk = layer(1, LOOM_LAYER_POSITIONAL_EMBEDDING, "pk");
    pk->max_length = S, pk->n_inputs = 1;
    snprintf(pk->inputs[0], LOOM_NAME_MAX, "k");
    loom_layer_spec *l = layer(2, LOOM_LAYER_MULTI_HEAD_ATTENTION, "mha");
    l->num_heads = H, l->key_dim = DK, l->value_dim = DV, l->n_inputs = 3;
    snprintf(l->inputs[0], LOOM_NAME_MAX, "q");
    snprintf(l->inputs[1], LOOM_NAME_MAX, "pv");
    snprintf(l->inputs[2], LOOM_NAME_MAX, "pk");
    loom_shape in[3] = {{.rank = 2, .dim = {T, D}}, {.rank = 2, .dim = {S, DVI}}, {.rank = 2, .dim = {S, DKI}}};
    loom_dtype dt[3] = {LOOM_F32, LOOM_F32, LOOM_F32};
    loom_model *m = NULL;
    int rc = loom_model_new_inputs(&m, &spec, 3, in, dt, &in[0], LOOM_F32, B, &err);
    CHECK_MSG(rc == LOOM_OK, "%s: %s", err.where, err.msg);
    if (rc) return;
    CHECK(loom_model_num_param_tensors(m) == 10);
    float *P = loom_model_params(m);
    for (int t = 2; t < 10; t++) {
        const loom_param_info *p = loom_model_param_tensor(m, t);
        fill(P + p->offset, loom_shape_numel(&p->shape), t);
    }
    float x[B * T * D], y[B * T * D], xv[B * S * DVI], xk[B * S * DKI];
    fill(x, B * T * D, 1), fill(y, B * T * D, 10), fill(xv, B * S * DVI, 11), fill(xk, B * S * DKI, 12);
    loom_shape bs = {.rank = 3, .dim = {B, T, D}}, vs = {.rank = 3, .dim = {B, S, DVI}}, ks = {.rank = 3, .dim = {B, S, DKI}};
    loom_tensor xt = {.dtype = LOOM_F32, .shape = bs, .data = x}, yt = {.dtype = LOOM_F32, .shape = bs, .data = y};
    loom_tensor vt = {.dtype = LOOM_F32, .shape = vs, .data = xv}, kt = {.dtype = LOOM_F32, .shape = ks, .data = xk};
    const loom_tensor *more[2] = {&vt, &kt};
    loom_model_set_inputs(m, more, 2);
    double loss;
    int64_t ok;
    CHECK(loom_model_train_step(m, &xt, &yt, B, 1, &loss, &ok, &err) == LOOM_OK);
    float out[B * T * D];
    CHECK(loom_model_predict(m, &xt, out, &err) == LOOM_OK);
    check_near("y", out, want_y_cross, B * T * D, 1e-5);
    const float *G = loom_model_grads(m);
    check_near("d value", G + loom_model_param_tensor(m, 0)->offset, want_dv_cross, S * DVI, 1e-5);
    check_near("d key", G + loom_model_param_tensor(m, 1)->offset, want_dk_cross, S * DKI, 1e-5);
    const double *wg[8] = {want_g0_cross, want_g1_cross, want_g2_cross, want_g3_cross,
                           want_g4_cross, want_g5_cross, want_g6_cross, want_g7_cross};
    for (int t = 0; t < 8; t++) {
        const loom_param_info *p = loom_model_param_tensor(m, 2 + t);
        check_near(p->name, G + p->offset, wg[t], loom_shape_numel(&p->shape), 1e-5);
    }
    loom_model_free(m);
}

static const loom_test tests[] = {
    {"mha [query, value, key] vs torch", test_torch_cross},
    {"key padding mask", test_key_padding},
    {"mha vs torch", test_torch_full},
    {"mha causal vs torch", test_torch_causal},
    {"causal prefix", test_causal_prefix},
    {"sinusoidal table", test_sinusoidal},
    {"learned table gradient", test_learned_grad},
    {"bad shapes", test_needs_sequence},
    {"dropout across threads", test_dropout_threads},
    {0},
};

int main(void)
{
    if (loom_blas_init(1, &err) != LOOM_OK) {
        printf("Bail out! %s: %s\n", err.where, err.msg);
        return 1;
    }
    return loom_test_run(tests);
}

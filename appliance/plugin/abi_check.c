/* abi_check.c - compile-time proof that plugins/loom_plugin.h restates
 * Loom's own types exactly: the same error codes, log levels, reduction ops,
 * dtypes and limits, and the same layout of loom_err, of tensors and
 * elements, and of every vtable and struct a plugin shares with Loom. The ABI header is included first with its names
 * renamed (abi_*), then Loom's headers; a drift on either side stops the
 * build here instead of corrupting memory in a plugin.
 * Nothing in this file runs. */
#define loom_errcode                  abi_loom_errcode
#define loom_err                      abi_loom_err
#define loom_log_level                abi_loom_log_level
#define loom_redop                    abi_loom_redop
#define loom_cross_device_ops         abi_loom_cross_device_ops
#define loom_job_args                 abi_loom_job_args
#define loom_strategy                 abi_loom_strategy
#define loom_strategy_args            abi_loom_strategy_args
#define loom_step_result              abi_loom_step_result
#define loom_strategy_ops             abi_loom_strategy_ops
#define loom_role                     abi_loom_role
#define loom_role_use                 abi_loom_role_use
#define loom_cluster_roles            abi_loom_cluster_roles
#define LOOM_ROLE_CHIEF               ABI_LOOM_ROLE_CHIEF
#define LOOM_ROLE_WORKER              ABI_LOOM_ROLE_WORKER
#define LOOM_ROLE_PS                  ABI_LOOM_ROLE_PS
#define LOOM_ROLE_EVALUATOR           ABI_LOOM_ROLE_EVALUATOR
#define LOOM_ROLE_COUNT               ABI_LOOM_ROLE_COUNT
#define LOOM_ROLE_ALLOWED             ABI_LOOM_ROLE_ALLOWED
#define LOOM_ROLE_REFUSED             ABI_LOOM_ROLE_REFUSED
#define LOOM_ROLE_REQUIRED            ABI_LOOM_ROLE_REQUIRED
#define loom_input_ctx                abi_loom_input_ctx
#define loom_step_part                abi_loom_step_part
#define loom_device                   abi_loom_device
#define loom_dev_act                  abi_loom_dev_act
#define loom_dev_binop                abi_loom_dev_binop
#define loom_dev_reduce               abi_loom_dev_reduce
#define loom_dev_window               abi_loom_dev_window
#define loom_device_ops               abi_loom_device_ops
#define loom_dtype                    abi_loom_dtype
#define loom_shape                    abi_loom_shape
#define loom_tensor                   abi_loom_tensor
#define loom_elem_spec                abi_loom_elem_spec
#define loom_elem                     abi_loom_elem
#define loom_options                  abi_loom_options
#define loom_custom_args              abi_loom_custom_args
#define loom_custom_key               abi_loom_custom_key
#define loom_custom_ops               abi_loom_custom_ops
#define loom_source_args              abi_loom_source_args
#define loom_source_ops               abi_loom_source_ops
#define LOOM_ABI_DTYPES_(X) X(U8) X(I32) X(I64) X(F32) X(F64) X(NDTYPES_)
#define LOOM_U8                 ABI_LOOM_U8
#define LOOM_I32                ABI_LOOM_I32
#define LOOM_I64                ABI_LOOM_I64
#define LOOM_F32                ABI_LOOM_F32
#define LOOM_F64                ABI_LOOM_F64
#define LOOM_NDTYPES_           ABI_LOOM_NDTYPES_
#define LOOM_ABI_DEV_CONSTS_(X) X(DEV_ACT_NONE) X(DEV_ACT_RELU) X(DEV_ACT_SIGMOID) X(DEV_ACT_TANH) X(DEV_ADD) \
    X(DEV_SUB) X(DEV_MUL) X(DEV_SUM) X(DEV_MAX) X(DEV_STREAM_COMPUTE) X(DEV_STREAM_COPY)
#define LOOM_DEV_ACT_NONE       ABI_LOOM_DEV_ACT_NONE
#define LOOM_DEV_ACT_RELU       ABI_LOOM_DEV_ACT_RELU
#define LOOM_DEV_ACT_SIGMOID    ABI_LOOM_DEV_ACT_SIGMOID
#define LOOM_DEV_ACT_TANH       ABI_LOOM_DEV_ACT_TANH
#define LOOM_DEV_ADD            ABI_LOOM_DEV_ADD
#define LOOM_DEV_SUB            ABI_LOOM_DEV_SUB
#define LOOM_DEV_MUL            ABI_LOOM_DEV_MUL
#define LOOM_DEV_SUM            ABI_LOOM_DEV_SUM
#define LOOM_DEV_MAX            ABI_LOOM_DEV_MAX
#define LOOM_DEV_STREAM_COMPUTE ABI_LOOM_DEV_STREAM_COMPUTE
#define LOOM_DEV_STREAM_COPY    ABI_LOOM_DEV_STREAM_COPY
#define LOOM_ABI_CODES_(X) X(OK) X(NOMEM) X(CONFIG) X(USAGE) X(IO) X(DATA) X(SHAPE) X(CHECKPOINT) X(NUMERIC) \
    X(UNSUPPORTED) X(CUDA) X(NCCL) X(NET) X(LUA) X(PLUGIN) X(EOF) X(TIMEOUT)
#define LOOM_EOK          ABI_LOOM_EOK
#define LOOM_ENOMEM       ABI_LOOM_ENOMEM
#define LOOM_ECONFIG      ABI_LOOM_ECONFIG
#define LOOM_EUSAGE       ABI_LOOM_EUSAGE
#define LOOM_EIO          ABI_LOOM_EIO
#define LOOM_EDATA        ABI_LOOM_EDATA
#define LOOM_ESHAPE       ABI_LOOM_ESHAPE
#define LOOM_ECHECKPOINT  ABI_LOOM_ECHECKPOINT
#define LOOM_ENUMERIC     ABI_LOOM_ENUMERIC
#define LOOM_EUNSUPPORTED ABI_LOOM_EUNSUPPORTED
#define LOOM_ECUDA        ABI_LOOM_ECUDA
#define LOOM_ENCCL        ABI_LOOM_ENCCL
#define LOOM_ENET         ABI_LOOM_ENET
#define LOOM_ELUA         ABI_LOOM_ELUA
#define LOOM_EPLUGIN      ABI_LOOM_EPLUGIN
#define LOOM_EEOF         ABI_LOOM_EEOF
#define LOOM_ETIMEOUT     ABI_LOOM_ETIMEOUT
#define LOOM_LOG_DEBUG    ABI_LOOM_LOG_DEBUG
#define LOOM_LOG_INFO     ABI_LOOM_LOG_INFO
#define LOOM_LOG_WARN     ABI_LOOM_LOG_WARN
#define LOOM_LOG_ERROR    ABI_LOOM_LOG_ERROR
#define LOOM_REDUCE_SUM   ABI_LOOM_REDUCE_SUM
#define LOOM_REDUCE_MEAN  ABI_LOOM_REDUCE_MEAN
#define LOOM_REDUCE_MAX   ABI_LOOM_REDUCE_MAX
#define LOOM_PART_FORWARD    ABI_LOOM_PART_FORWARD
#define LOOM_PART_LOSS       ABI_LOOM_PART_LOSS
#define LOOM_PART_BACKWARD   ABI_LOOM_PART_BACKWARD
#define LOOM_PART_ALL_REDUCE ABI_LOOM_PART_ALL_REDUCE
#define LOOM_PART_APPLY      ABI_LOOM_PART_APPLY
#define loom_layer_init               abi_loom_layer_init
#define loom_layer_settings           abi_loom_layer_settings
#define loom_layer_param              abi_loom_layer_param
#define loom_layer_args               abi_loom_layer_args
#define loom_layer_plan               abi_loom_layer_plan
#define loom_layer_call               abi_loom_layer_call
#define loom_layer_onnx               abi_loom_layer_onnx
#define loom_layer_ops                abi_loom_layer_ops
#define LOOM_LINIT_ZEROS              ABI_LOOM_LINIT_ZEROS
#define LOOM_LINIT_ONES               ABI_LOOM_LINIT_ONES
#define LOOM_LINIT_CONSTANT           ABI_LOOM_LINIT_CONSTANT
#define LOOM_LINIT_GLOROT_UNIFORM     ABI_LOOM_LINIT_GLOROT_UNIFORM
#define LOOM_LINIT_HE_NORMAL          ABI_LOOM_LINIT_HE_NORMAL
#include "loom_plugin.h"
enum { ABI_XOPS_VERSION = LOOM_CROSS_DEVICE_OPS_VERSION, ABI_STRATEGY_VERSION = LOOM_STRATEGY_OPS_VERSION,
       ABI_STRATEGY_OWN_THREADS = LOOM_STRATEGY_OWN_THREADS };
enum { ABI_ROLES_ONE_PROCESS = LOOM_ROLES_ONE_PROCESS, ABI_ROLES_REJOIN = LOOM_ROLES_REJOIN };
enum { ABI_XOPS_HOST_MEM = LOOM_XOPS_HOST_MEM, ABI_XOPS_DEVICE_MEM = LOOM_XOPS_DEVICE_MEM };
enum { ABI_DEVICE_VERSION = LOOM_DEVICE_OPS_VERSION };
enum { ABI_LAYER_VERSION = LOOM_LAYER_OPS_VERSION, ABI_LAYER_MAX_PARAMS = LOOM_LAYER_MAX_PARAMS,
       ABI_LAYER_MAX_INPUTS = LOOM_LAYER_MAX_INPUTS };
enum { ABI_CUSTOM_VERSION = LOOM_CUSTOM_OPS_VERSION, ABI_SOURCE_VERSION = LOOM_SOURCE_OPS_VERSION,
       ABI_MAX_RANK = LOOM_MAX_RANK, ABI_MAX_FEATURES = LOOM_MAX_FEATURES, ABI_NAME_MAX = LOOM_NAME_MAX,
       ABI_MAX_OPTIONS = LOOM_MAX_OPTIONS };
#undef loom_dtype
#undef loom_shape
#undef loom_tensor
#undef loom_elem_spec
#undef loom_elem
#undef loom_options
#undef loom_custom_args
#undef loom_custom_key
#undef loom_custom_ops
#undef loom_source_args
#undef loom_source_ops
#undef LOOM_U8
#undef LOOM_I32
#undef LOOM_I64
#undef LOOM_F32
#undef LOOM_F64
#undef LOOM_NDTYPES_
#undef LOOM_CUSTOM_OPS_VERSION
#undef LOOM_SOURCE_OPS_VERSION
#undef LOOM_MAX_RANK
#undef LOOM_MAX_FEATURES
#undef LOOM_NAME_MAX
#undef LOOM_MAX_OPTIONS
#undef loom_device
#undef loom_dev_act
#undef loom_dev_binop
#undef loom_dev_reduce
#undef loom_dev_window
#undef loom_device_ops
#undef LOOM_DEVICE_OPS_VERSION
#undef LOOM_DEV_ACT_NONE
#undef LOOM_DEV_ACT_RELU
#undef LOOM_DEV_ACT_SIGMOID
#undef LOOM_DEV_ACT_TANH
#undef LOOM_DEV_ADD
#undef LOOM_DEV_SUB
#undef LOOM_DEV_MUL
#undef LOOM_DEV_SUM
#undef LOOM_DEV_MAX
#undef LOOM_DEV_STREAM_COMPUTE
#undef LOOM_DEV_STREAM_COPY
#undef loom_layer_init
#undef loom_layer_settings
#undef LOOM_LAYER_MAX_SETTINGS
#undef loom_layer_param
#undef loom_layer_args
#undef loom_layer_plan
#undef loom_layer_call
#undef loom_layer_onnx
#undef loom_layer_ops
#undef LOOM_LINIT_ZEROS
#undef LOOM_LINIT_ONES
#undef LOOM_LINIT_CONSTANT
#undef LOOM_LINIT_GLOROT_UNIFORM
#undef LOOM_LINIT_HE_NORMAL
#undef LOOM_LAYER_OPS_VERSION
#undef LOOM_LAYER_MAX_PARAMS
#undef LOOM_LAYER_MAX_INPUTS
#undef LOOM_NN_LAYER_PLUGIN_H
#undef loom_errcode
#undef loom_err
#undef loom_log_level
#undef loom_redop
#undef loom_cross_device_ops
#undef loom_job_args
#undef loom_strategy
#undef loom_strategy_args
#undef loom_step_result
#undef loom_strategy_ops
#undef loom_role
#undef loom_role_use
#undef loom_cluster_roles
#undef LOOM_ROLE_CHIEF
#undef LOOM_ROLE_WORKER
#undef LOOM_ROLE_PS
#undef LOOM_ROLE_EVALUATOR
#undef LOOM_ROLE_COUNT
#undef LOOM_ROLE_ALLOWED
#undef LOOM_ROLE_REFUSED
#undef LOOM_ROLE_REQUIRED
#undef LOOM_ROLES_ONE_PROCESS
#undef LOOM_ROLES_REJOIN
#undef loom_input_ctx
#undef LOOM_STRATEGY_OWN_THREADS
#undef loom_step_part
#undef LOOM_CROSS_DEVICE_OPS_VERSION
#undef LOOM_XOPS_HOST_MEM
#undef LOOM_XOPS_DEVICE_MEM
#undef LOOM_STRATEGY_OPS_VERSION
#undef LOOM_PART_FORWARD
#undef LOOM_PART_LOSS
#undef LOOM_PART_BACKWARD
#undef LOOM_PART_ALL_REDUCE
#undef LOOM_PART_APPLY
#undef LOOM_EOK
#undef LOOM_ENOMEM
#undef LOOM_ECONFIG
#undef LOOM_EUSAGE
#undef LOOM_EIO
#undef LOOM_EDATA
#undef LOOM_ESHAPE
#undef LOOM_ECHECKPOINT
#undef LOOM_ENUMERIC
#undef LOOM_EUNSUPPORTED
#undef LOOM_ECUDA
#undef LOOM_ENCCL
#undef LOOM_ENET
#undef LOOM_ELUA
#undef LOOM_EPLUGIN
#undef LOOM_EEOF
#undef LOOM_ETIMEOUT
#undef LOOM_LOG_DEBUG
#undef LOOM_LOG_INFO
#undef LOOM_LOG_WARN
#undef LOOM_LOG_ERROR
#undef LOOM_REDUCE_SUM
#undef LOOM_REDUCE_MEAN
#undef LOOM_REDUCE_MAX

#include "distribute/distribute.h"
#include "tensor/tensor.h"
#include "data/data.h"
#include "nn/nn.h"

#include <stddef.h>

/* Same value for every error code, and no code on one side only. */
#define SAME_CODE_(name) _Static_assert((int)ABI_LOOM_E##name == (int)LOOM_E##name, "error code " #name);
LOOM_ABI_CODES_(SAME_CODE_)
_Static_assert((int)ABI_LOOM_ETIMEOUT + 1 == (int)LOOM_ENUM_ERRORS_, "loom_plugin.h lacks an error code of core.h");

_Static_assert((int)ABI_LOOM_LOG_DEBUG == (int)LOOM_LOG_DEBUG && (int)ABI_LOOM_LOG_INFO == (int)LOOM_LOG_INFO &&
                   (int)ABI_LOOM_LOG_WARN == (int)LOOM_LOG_WARN && (int)ABI_LOOM_LOG_ERROR == (int)LOOM_LOG_ERROR,
               "log levels");
_Static_assert((int)ABI_LOOM_REDUCE_SUM == (int)LOOM_REDUCE_SUM && (int)ABI_LOOM_REDUCE_MEAN == (int)LOOM_REDUCE_MEAN &&
                   (int)ABI_LOOM_REDUCE_MAX == (int)LOOM_REDUCE_MAX,
               "reduction ops");
_Static_assert((int)ABI_LOOM_PART_FORWARD == (int)LOOM_PART_FORWARD && (int)ABI_LOOM_PART_LOSS == (int)LOOM_PART_LOSS &&
                   (int)ABI_LOOM_PART_BACKWARD == (int)LOOM_PART_BACKWARD &&
                   (int)ABI_LOOM_PART_ALL_REDUCE == (int)LOOM_PART_ALL_REDUCE &&
                   (int)ABI_LOOM_PART_APPLY == (int)LOOM_PART_APPLY,
               "step parts");
_Static_assert(ABI_XOPS_VERSION == LOOM_CROSS_DEVICE_OPS_VERSION, "cross-device ops version");
_Static_assert(ABI_XOPS_HOST_MEM == LOOM_XOPS_HOST_MEM && ABI_XOPS_DEVICE_MEM == LOOM_XOPS_DEVICE_MEM,
               "cross-device ops memory caps");
_Static_assert(ABI_STRATEGY_VERSION == LOOM_STRATEGY_OPS_VERSION, "strategy ops version");
_Static_assert(ABI_STRATEGY_OWN_THREADS == LOOM_STRATEGY_OWN_THREADS, "strategy caps");
_Static_assert((int)ABI_LOOM_ROLE_CHIEF == (int)LOOM_ROLE_CHIEF && (int)ABI_LOOM_ROLE_WORKER == (int)LOOM_ROLE_WORKER &&
                   (int)ABI_LOOM_ROLE_PS == (int)LOOM_ROLE_PS && (int)ABI_LOOM_ROLE_EVALUATOR == (int)LOOM_ROLE_EVALUATOR &&
                   (int)ABI_LOOM_ROLE_COUNT == (int)LOOM_ROLE_COUNT,
               "cluster roles");
_Static_assert((int)ABI_LOOM_ROLE_ALLOWED == (int)LOOM_ROLE_ALLOWED && (int)ABI_LOOM_ROLE_REFUSED == (int)LOOM_ROLE_REFUSED &&
                   (int)ABI_LOOM_ROLE_REQUIRED == (int)LOOM_ROLE_REQUIRED,
               "role uses");
_Static_assert(ABI_ROLES_ONE_PROCESS == LOOM_ROLES_ONE_PROCESS && ABI_ROLES_REJOIN == LOOM_ROLES_REJOIN, "roles flags");

/* Same size, and each member at the same offset with the same size. */
#define SAME_SIZE_(T) _Static_assert(sizeof(abi_##T) == sizeof(T), "size of " #T);
#define SAME_FIELD_(T, f)                                                                                   \
    _Static_assert(offsetof(abi_##T, f) == offsetof(T, f) && sizeof(((abi_##T *)0)->f) == sizeof(((T *)0)->f), \
                   #T "." #f);

SAME_SIZE_(loom_err)
SAME_FIELD_(loom_err, code)
SAME_FIELD_(loom_err, where)
SAME_FIELD_(loom_err, msg)
SAME_FIELD_(loom_err, hint)

SAME_SIZE_(loom_cross_device_ops)
SAME_FIELD_(loom_cross_device_ops, version)
SAME_FIELD_(loom_cross_device_ops, name)
SAME_FIELD_(loom_cross_device_ops, all_reduce)
SAME_FIELD_(loom_cross_device_ops, broadcast)
SAME_FIELD_(loom_cross_device_ops, all_gather)
SAME_FIELD_(loom_cross_device_ops, comm_new)
SAME_FIELD_(loom_cross_device_ops, comm_free)
SAME_FIELD_(loom_cross_device_ops, all_reduce_rank)
SAME_FIELD_(loom_cross_device_ops, broadcast_rank)
SAME_FIELD_(loom_cross_device_ops, all_gather_rank)
SAME_FIELD_(loom_cross_device_ops, caps)
SAME_FIELD_(loom_cross_device_ops, job_open)
SAME_FIELD_(loom_cross_device_ops, job_close)
SAME_FIELD_(loom_cross_device_ops, job_all_reduce)

#define LOOM_ABI_JOB_ARGS_FIELDS_(X) X(size) X(rank) X(ranks) X(task) X(where) X(timeout_s) X(boot) \
    X(boot_broadcast) X(boot_all_gather) X(timeout_where) X(boot_lost) X(boot_failing)
#define SAME_JOB_ARGS_FIELD_(f) SAME_FIELD_(loom_job_args, f)
SAME_SIZE_(loom_job_args)
LOOM_ABI_JOB_ARGS_FIELDS_(SAME_JOB_ARGS_FIELD_)

SAME_SIZE_(loom_strategy_args)
SAME_FIELD_(loom_strategy_args, spec)
SAME_FIELD_(loom_strategy_args, input)
SAME_FIELD_(loom_strategy_args, input_idx)
SAME_FIELD_(loom_strategy_args, label_idx)
SAME_FIELD_(loom_strategy_args, max_batch)
SAME_FIELD_(loom_strategy_args, cluster)
SAME_FIELD_(loom_strategy_args, plan_only)
SAME_FIELD_(loom_strategy_args, steps_per_epoch)
SAME_FIELD_(loom_strategy_args, weight_idx1)
SAME_FIELD_(loom_strategy_args, n_inputs)
SAME_FIELD_(loom_strategy_args, inputs_idx)
SAME_FIELD_(loom_strategy_args, n_heads)
SAME_FIELD_(loom_strategy_args, heads_idx)
SAME_FIELD_(loom_strategy_args, model_dir)

SAME_SIZE_(loom_input_ctx)
SAME_FIELD_(loom_input_ctx, num_input_pipelines)
SAME_FIELD_(loom_input_ctx, input_pipeline_id)
SAME_FIELD_(loom_input_ctx, num_replicas_in_sync)
SAME_FIELD_(loom_input_ctx, seed_key)

SAME_SIZE_(loom_step_result)
SAME_FIELD_(loom_step_result, loss_sum)
SAME_FIELD_(loom_step_result, correct)
SAME_FIELD_(loom_step_result, examples)

SAME_SIZE_(loom_strategy_ops)
SAME_FIELD_(loom_strategy_ops, version)
SAME_FIELD_(loom_strategy_ops, name)
SAME_FIELD_(loom_strategy_ops, open)
SAME_FIELD_(loom_strategy_ops, close)
SAME_FIELD_(loom_strategy_ops, train_step)
SAME_FIELD_(loom_strategy_ops, eval_step)
SAME_FIELD_(loom_strategy_ops, predict)
SAME_FIELD_(loom_strategy_ops, model)
SAME_FIELD_(loom_strategy_ops, optimizer)
SAME_FIELD_(loom_strategy_ops, sync)
SAME_FIELD_(loom_strategy_ops, num_replicas)
SAME_FIELD_(loom_strategy_ops, step_part)
SAME_FIELD_(loom_strategy_ops, replica)
SAME_FIELD_(loom_strategy_ops, caps)
SAME_FIELD_(loom_strategy_ops, print_plan)
SAME_FIELD_(loom_strategy_ops, where)
SAME_FIELD_(loom_strategy_ops, input_context)
SAME_FIELD_(loom_strategy_ops, is_chief)
SAME_FIELD_(loom_strategy_ops, gather_iter_state)
SAME_FIELD_(loom_strategy_ops, pick_iter_state)
SAME_FIELD_(loom_strategy_ops, request_stop)
SAME_FIELD_(loom_strategy_ops, stop_agreed)
SAME_FIELD_(loom_strategy_ops, end_of_data)
SAME_FIELD_(loom_strategy_ops, peers)
SAME_FIELD_(loom_strategy_ops, serve)
SAME_FIELD_(loom_strategy_ops, roles)

SAME_SIZE_(loom_cluster_roles)
SAME_FIELD_(loom_cluster_roles, flags)
SAME_FIELD_(loom_cluster_roles, use)
SAME_FIELD_(loom_cluster_roles, why)
SAME_FIELD_(loom_cluster_roles, hint)
SAME_FIELD_(loom_cluster_roles, check)

SAME_SIZE_(loom_strategy)
SAME_FIELD_(loom_strategy, ops)
SAME_FIELD_(loom_strategy, xops)
SAME_FIELD_(loom_strategy, args)
SAME_FIELD_(loom_strategy, impl)
SAME_FIELD_(loom_strategy, failing)

/* Device backends: the constants, and the vtable field by field. */
#define SAME_DEV_CONST_(name) _Static_assert((int)ABI_LOOM_##name == (int)LOOM_##name, "device constant " #name);
LOOM_ABI_DEV_CONSTS_(SAME_DEV_CONST_)
_Static_assert(ABI_DEVICE_VERSION == LOOM_DEVICE_OPS_VERSION, "device ops version");
SAME_SIZE_(loom_dev_window)
SAME_FIELD_(loom_dev_window, batch)
SAME_FIELD_(loom_dev_window, c)
SAME_FIELD_(loom_dev_window, sw)
SAME_FIELD_(loom_dev_window, pad_l)
SAME_FIELD_(loom_dev_window, cout)
#define LOOM_ABI_DEVICE_FIELDS_(X) X(version) X(name) X(probe) X(describe) X(open) X(close) X(alloc) X(free) \
    X(host_alloc) X(host_free) X(upload) X(download) X(stream_wait) X(synchronize) X(gemm) X(binary) X(axpy) \
    X(scale) X(bias_act) X(act_backward) X(bias_grad) X(reduce) X(softmax_xent) X(conv2d_forward) \
    X(conv2d_backward) X(maxpool_forward) X(maxpool_backward) X(copy2d)
#define SAME_DEVICE_FIELD_(f) SAME_FIELD_(loom_device_ops, f)
SAME_SIZE_(loom_device_ops)
LOOM_ABI_DEVICE_FIELDS_(SAME_DEVICE_FIELD_)

/* Tensors and elements: the dtypes, the limits, and the structs field by field. */
#define SAME_DTYPE_(name) _Static_assert((int)ABI_LOOM_##name == (int)LOOM_##name, "dtype " #name);
LOOM_ABI_DTYPES_(SAME_DTYPE_)
_Static_assert(ABI_MAX_RANK == LOOM_MAX_RANK && ABI_MAX_FEATURES == LOOM_MAX_FEATURES && ABI_NAME_MAX == LOOM_NAME_MAX &&
                   ABI_MAX_OPTIONS == LOOM_MAX_OPTIONS && ABI_MAX_OPTIONS == LOOM_MAX_PLUGIN_OPTS,
               "limits");
_Static_assert(ABI_CUSTOM_VERSION == LOOM_CUSTOM_OPS_VERSION, "custom ops version");
_Static_assert(ABI_SOURCE_VERSION == LOOM_SOURCE_OPS_VERSION, "source ops version");
SAME_SIZE_(loom_dtype)
SAME_SIZE_(loom_shape)
SAME_FIELD_(loom_shape, rank)
SAME_FIELD_(loom_shape, dim)
SAME_SIZE_(loom_tensor)
SAME_FIELD_(loom_tensor, dtype)
SAME_FIELD_(loom_tensor, shape)
SAME_FIELD_(loom_tensor, data)
SAME_FIELD_(loom_tensor, owns)
SAME_SIZE_(loom_elem_spec)
SAME_FIELD_(loom_elem_spec, n)
SAME_FIELD_(loom_elem_spec, name)
SAME_FIELD_(loom_elem_spec, dtype)
SAME_FIELD_(loom_elem_spec, shape)
SAME_SIZE_(loom_elem)
SAME_FIELD_(loom_elem, n)
SAME_FIELD_(loom_elem, t)

/* Transform and source providers. */
SAME_SIZE_(loom_options)
SAME_FIELD_(loom_options, n)
SAME_FIELD_(loom_options, key)
SAME_FIELD_(loom_options, value)
SAME_FIELD_(loom_options, where)
#define LOOM_ABI_CUSTOM_ARGS_FIELDS_(X) X(size) X(ref) X(base_dir) X(where) X(in) X(in_max) X(filter) X(max_calls) \
    X(seed) X(options) X(args)
#define SAME_CUSTOM_ARGS_FIELD_(f) SAME_FIELD_(loom_custom_args, f)
SAME_SIZE_(loom_custom_args)
LOOM_ABI_CUSTOM_ARGS_FIELDS_(SAME_CUSTOM_ARGS_FIELD_)
SAME_SIZE_(loom_custom_key)
SAME_FIELD_(loom_custom_key, seed)
SAME_FIELD_(loom_custom_key, stage)
SAME_FIELD_(loom_custom_key, epoch)
SAME_FIELD_(loom_custom_key, index)
SAME_SIZE_(loom_custom_ops)
SAME_FIELD_(loom_custom_ops, version)
SAME_FIELD_(loom_custom_ops, name)
SAME_FIELD_(loom_custom_ops, open)
SAME_FIELD_(loom_custom_ops, map)
SAME_FIELD_(loom_custom_ops, filter)
SAME_FIELD_(loom_custom_ops, close)
SAME_SIZE_(loom_source_args)
SAME_FIELD_(loom_source_args, size)
SAME_FIELD_(loom_source_args, type)
SAME_FIELD_(loom_source_args, base_dir)
SAME_FIELD_(loom_source_args, where)
SAME_FIELD_(loom_source_args, options)
SAME_FIELD_(loom_source_args, seed)
#define LOOM_ABI_SOURCE_FIELDS_(X) X(version) X(name) X(options) X(open) X(cardinality) X(rewind) X(next) X(save) \
    X(restore) X(close)
#define SAME_SOURCE_FIELD_(f) SAME_FIELD_(loom_source_ops, f)
SAME_SIZE_(loom_source_ops)
LOOM_ABI_SOURCE_FIELDS_(SAME_SOURCE_FIELD_)

/* Plugin layer kinds. */
#define SAME_LINIT_(name) _Static_assert((int)ABI_LOOM_LINIT_##name == (int)LOOM_LINIT_##name, "layer init " #name);
SAME_LINIT_(ZEROS) SAME_LINIT_(ONES) SAME_LINIT_(CONSTANT) SAME_LINIT_(GLOROT_UNIFORM) SAME_LINIT_(HE_NORMAL)
_Static_assert(ABI_LAYER_VERSION == LOOM_LAYER_OPS_VERSION && ABI_LAYER_MAX_PARAMS == LOOM_LAYER_MAX_PARAMS &&
                   ABI_LAYER_MAX_INPUTS == LOOM_LAYER_MAX_INPUTS && LOOM_LAYER_MAX_INPUTS == LOOM_MAX_LAYER_INPUTS,
               "layer ops version and limits");
SAME_SIZE_(loom_layer_settings)
SAME_FIELD_(loom_layer_settings, n)
SAME_FIELD_(loom_layer_settings, key)
SAME_FIELD_(loom_layer_settings, value)
SAME_FIELD_(loom_layer_settings, where)
_Static_assert(LOOM_LAYER_MAX_SETTINGS == LOOM_MAX_PLUGIN_OPTS, "layer settings");
#define LOOM_ABI_LAYER_PARAM_FIELDS_(X) X(name) X(shape) X(init) X(value) X(trainable)
#define SAME_LAYER_PARAM_FIELD_(f) SAME_FIELD_(loom_layer_param, f)
SAME_SIZE_(loom_layer_param)
LOOM_ABI_LAYER_PARAM_FIELDS_(SAME_LAYER_PARAM_FIELD_)
#define LOOM_ABI_LAYER_ARGS_FIELDS_(X) X(size) X(type) X(name) X(where) X(settings) X(n_in) X(in) X(max_batch)
#define SAME_LAYER_ARGS_FIELD_(f) SAME_FIELD_(loom_layer_args, f)
SAME_SIZE_(loom_layer_args)
LOOM_ABI_LAYER_ARGS_FIELDS_(SAME_LAYER_ARGS_FIELD_)
#define LOOM_ABI_LAYER_PLAN_FIELDS_(X) X(out) X(n_params) X(param) X(scratch_per_example) X(scratch_fixed) \
    X(whole_batch)
#define SAME_LAYER_PLAN_FIELD_(f) SAME_FIELD_(loom_layer_plan, f)
SAME_SIZE_(loom_layer_plan)
LOOM_ABI_LAYER_PLAN_FIELDS_(SAME_LAYER_PLAN_FIELD_)
#define LOOM_ABI_LAYER_CALL_FIELDS_(X) X(size) X(b0) X(B) X(global_batch) X(n_in) X(x) X(y) X(param) X(scratch) \
    X(scratch_fixed) X(training) X(rng_key) X(dy) X(dx) X(dparam)
#define SAME_LAYER_CALL_FIELD_(f) SAME_FIELD_(loom_layer_call, f)
SAME_SIZE_(loom_layer_call)
LOOM_ABI_LAYER_CALL_FIELDS_(SAME_LAYER_CALL_FIELD_)
SAME_SIZE_(loom_layer_onnx)
SAME_FIELD_(loom_layer_onnx, op_type)
SAME_FIELD_(loom_layer_onnx, n_attr)
SAME_FIELD_(loom_layer_onnx, attr_name)
SAME_FIELD_(loom_layer_onnx, attr_value)
#define LOOM_ABI_LAYER_FIELDS_(X) X(version) X(name) X(options) X(build) X(free) X(forward) X(backward) \
    X(param_grads) X(onnx)
#define SAME_LAYER_FIELD_(f) SAME_FIELD_(loom_layer_ops, f)
SAME_SIZE_(loom_layer_ops)
LOOM_ABI_LAYER_FIELDS_(SAME_LAYER_FIELD_)

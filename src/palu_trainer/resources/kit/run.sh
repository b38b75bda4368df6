#!/bin/bash
# {contribution.name} in open-unlearning, as a pip-installable plugin: palu-trainer installed in this framework's environment
# (`pip install .` in its checkout) registers trainer={contribution.name} and its configs; nothing here is edited. Every
# array below can be set from the environment (a space-separated list) to run a smaller grid or another model.
# Offline: MODEL_PATH=a saved model folder, TOFU_DIR=a local copy of locuslab/TOFU (the plugin points the training data
# and the evaluators at it). RETAIN_LOGS: the retain model's evaluation, which FQ needs. Without CUDA, +runtime=cpu is
# added.
set -euo pipefail

export MASTER_PORT=$(python -c "import socket; s=socket.socket(); s.bind(('', 0)); print(s.getsockname()[1]); s.close()")
echo "Master Port: $MASTER_PORT"

models=(${{MODELS:-Llama-2-7b-chat-hf}})
forget_retain_splits=("${{SPLITS:-forget05 retain95}}")
per_device_train_batch_size=${{PER_DEVICE_TRAIN_BATCH_SIZE:-4}}
gradient_accumulation_steps=${{GRADIENT_ACCUMULATION_STEPS:-8}}
train_args=(${{TRAIN_ARGS:-}})  # more overrides of every training run
eval_args=(${{EVAL_ARGS:-}})
# BEST_MODEL=fq_at_mu_floor or fq_mu_mean: evaluate after every epoch and keep the epoch that rule picks
# (palu-trainer's configs/best_model/); unset: evaluate the final model only
if [ -n "${{BEST_MODEL:-}}" ]; then
    during_training=(+best_model=${{BEST_MODEL}})
else
    during_training=(trainer.args.eval_strategy=no trainer.args.eval_on_start=false)
fi
if ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    train_args=(+runtime=cpu "${{train_args[@]}}")
    eval_args=(+runtime=cpu "${{eval_args[@]}}")
fi

unlearn_and_evaluate() {{  # model forget_split retain_split lr {contribution.knob}
    local model=$1 forget_split=$2 retain_split=$3 lr=$4 {contribution.knob}=$5
    local task_name=tofu_${{model}}_${{forget_split}}_{contribution.name}_lr${{lr}}_{contribution.knob}${{{contribution.knob}}}
    local model_path=${{MODEL_PATH:-open-unlearning/tofu_${{model}}_full}}
    # the retain model's evaluation (the framework's scripts/tofu_finetune.sh writes it there), which FQ needs
    local retain_logs=${{RETAIN_LOGS:-saves/eval/tofu_${{model}}_${{retain_split}}/TOFU_EVAL.json}}
    if [ ! -f "${{retain_logs}}" ]; then
        echo "warning: no ${{retain_logs}} (the retain model's evaluation): forget_quality is not computed"
        retain_logs=null
    fi
    echo "${{task_name}}: unlearning ${{model_path}} with {contribution.name}"
    python src/train.py --config-name=unlearn.yaml \
        experiment={contribution.experiment} \
        task_name=${{task_name}} \
        model=${{model}} \
        forget_split=${{forget_split}} \
        holdout_split=holdout${{forget_split#forget}} \
        retain_split=${{retain_split}} \
        model.model_args.pretrained_model_name_or_path=${{model_path}} \
        model.tokenizer_args.pretrained_model_name_or_path=${{model_path}} \
        retain_logs_path=${{retain_logs}} \
        trainer.args.per_device_train_batch_size=${{per_device_train_batch_size}} \
        trainer.args.gradient_accumulation_steps=${{gradient_accumulation_steps}} \
        "${{during_training[@]}}" \
        trainer.args.learning_rate=${{lr}} \
        trainer.method_args.{contribution.knob}=${{{contribution.knob}}} \
        "${{train_args[@]}}"
    python src/eval.py \
        experiment=eval/tofu/default.yaml \
        forget_split=${{forget_split}} \
        holdout_split=holdout${{forget_split#forget}} \
        model=${{model}} \
        task_name=${{task_name}} \
        model.model_args.pretrained_model_name_or_path=saves/unlearn/${{task_name}} \
        model.tokenizer_args.pretrained_model_name_or_path=saves/unlearn/${{task_name}} \
        paths.output_dir=saves/unlearn/${{task_name}}/evals \
        retain_logs_path=${{retain_logs}} \
        "${{eval_args[@]}}"
}}

########################################################################################################################
############################################ Hyper parameter tuning ####################################################
########################################################################################################################
# The paper's grid: learning rate x {contribution.knob}

lrs=(${{LRS:-{learning_rates}}})
{contribution.knob}s=(${{KNOBS:-{knob_grid}}})

if [ "${{STAGE:-tune}}" = tune ]; then
    for split in "${{forget_retain_splits[@]}}"; do
        for model in "${{models[@]}}"; do
            for lr in "${{lrs[@]}}"; do
                for {contribution.knob} in "${{{contribution.knob}s[@]}}"; do
                    unlearn_and_evaluate "$model" $split "$lr" "${contribution.knob}"
                done
            done
        done
    done
fi

########################################################################################################################
############################################ Final best parameters #####################################################
########################################################################################################################
# The defaults of configs/trainer/{contribution.name}.yaml and the framework's TOFU recipe: learning rate {contribution.best[0]},
# {contribution.knob} {contribution.best[1]}, on every TOFU split

if [ "${{STAGE:-tune}}" = best ]; then
    for split in "forget01 retain99" "forget05 retain95" "forget10 retain90"; do
        for model in "${{models[@]}}"; do
            unlearn_and_evaluate "$model" $split {contribution.best[0]} {contribution.best[1]}
        done
    done
fi

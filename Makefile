# layerwise-offload developer entry points. Extra arguments: make test ARGS="tests/comfy -x"
.PHONY: setup test run

setup:
	bash scripts/setup_env.sh

test:
	bash scripts/test.sh $(ARGS)

run:
	bash scripts/run.sh $(ARGS)

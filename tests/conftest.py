"""Order of the template's tests for two workers (./test.sh: -n 2 --dist worksteal, which hands each worker one half
of the list and lets an idle one take tests from the end of the other's): the groups of the whole-suite test first,
so they start at once on the first worker; the next longest last, so the second worker runs them beside those (and
whichever worker is idle first takes what is left of the other's half)."""

FIRST = "test_own_model_and_data_pass_the_whole_suite"
LAST = (
    "test_a_transformer_lm_on_a_stream_passes_the_seam_tests",
    "test_the_hugging_face_recipes_resume_bitwise_under_ddp_and_fsdp",
    "test_dry_run_prepares_installs_tests_and_benchmarks_then_prints_one_table",
)


def pytest_collection_modifyitems(items):
    def place(item):
        name = item.originalname
        return 0 if name == FIRST else 2 if name in LAST else 1

    items.sort(key=place)  # stable: the others keep their order

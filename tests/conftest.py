"""Order of the template's tests for ./test.sh's workers (-n 3 --dist load: the first tests are dealt out in turn,
then each worker that is done takes the next): the longest first, so they start at once on different workers and
the short ones fill the gaps at the end."""

# The longest first (minutes each): the whole-suite groups, the replica groups' bake, the Hugging Face recipes, ...
LONGEST = (
    "test_own_model_and_data_pass_the_whole_suite",
    "test_replica_groups_yes_bakes_torchft_replica_groups_that_pass_their_tests",
    "test_the_hugging_face_recipes_resume_bitwise_under_ddp_and_fsdp",
    "test_dry_run_prepares_installs_tests_and_benchmarks_then_prints_one_table",
    "test_a_transformer_lm_on_a_stream_passes_the_seam_tests",
)


def pytest_collection_modifyitems(items):
    def place(item):
        name = item.originalname
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)

    items.sort(key=place)  # stable: the others keep their order

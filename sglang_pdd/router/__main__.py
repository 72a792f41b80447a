from sglang_pdd.router.cli import main

main()

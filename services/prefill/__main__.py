from tokenyard.services.worker.main import main

if __name__ == "__main__":
    main("prefill")
